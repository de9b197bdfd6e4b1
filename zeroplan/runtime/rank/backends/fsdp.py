"""Run a zeroplan task on PyTorch's own data-parallel engines, mapped from a ZeRO plan.

| plan              | engine                                                             |
|-------------------|--------------------------------------------------------------------|
| stage 0           | DistributedDataParallel + AdamW                                    |
| stage 1           | DDP + ZeroRedundancyOptimizer(AdamW) (optimizer states sharded)    |
| stage 2           | FSDP2 ``fully_shard(reshard_after_forward=False)`` per block + root |
| stage 3           | FSDP2 ``fully_shard()`` (reshard after forward) per block + root   |
| offload cpu       | FSDP2 ``CPUOffloadPolicy`` (stages 2–3; parameters, gradients and   |
|                   | the optimizer step move to host memory together)                   |
| checkpointing     | ``torch.utils.checkpoint`` per block                               |

Mixed precision: FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16|fp16, reduce_dtype=fp32)`` —
fp32 sharded master parameters and optimizer states, 16-bit compute — and ``torch.autocast`` for
DDP, the same master/compute split DeepSpeed's bf16/fp16 modes make. Precision ``bf16-pure``:
the model is cast with ``.to(torch.bfloat16)`` and trained as it is (no policy, no autocast),
so AdamW's states are bf16 too — torchtune's ``dtype: bf16``.

One process (world size 1) at stages 0–1 trains the bare module, as a single-device loop does:
DDP would add its reducer's gradient buckets for nothing.
"""

from __future__ import annotations

import contextlib

import torch

from zeroplan.runtime.rank.backends.common import apply_checkpointing, device_for_rank, task_blocks, to_device
from zeroplan.spec import SpecError

__all__ = ["run_fsdp", "wrap_model"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "bf16-pure": torch.bfloat16}


def _mixed(precision: str) -> bool:
    """Whether ``precision`` computes in 16 bits over fp32 parameters (bf16, fp16)."""
    return precision in ("bf16", "fp16")


def wrap_model(model, *, blocks: list, plan, precision: str, device: torch.device):
    """(wrapped model, kind) for ``plan``: kind is ``single`` (one process, stages 0–1),
    ``ddp`` or ``fsdp2``."""
    import torch.distributed as dist

    if precision == "bf16-pure":
        model = model.to(torch.bfloat16)
    if plan.offload_param == "nvme" or plan.offload_optimizer == "nvme":
        raise SpecError("backend fsdp has no NVMe offload; use --backend deepspeed or offload cpu")
    offload = plan.offload_param == "cpu" or plan.offload_optimizer == "cpu"
    if plan.stage <= 1:
        if offload:
            raise SpecError("backend fsdp offloads only with FSDP2 (stage 2 or 3); use --stage 2 or 3")
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = model.to(device)
        if dist.get_world_size() == 1:
            return model, "single"
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None), "ddp"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    dtype = _DTYPES[precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if _mixed(precision) else MixedPrecisionPolicy()
    kwargs = {
        "mesh": mesh,
        "reshard_after_forward": plan.stage == 3,
        "mp_policy": mp,
        # Pinned host buffers need an accelerator; on a CPU-only machine the "offloaded" copy
        # lives in the same memory anyway, so pin nothing.
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy(),
    }
    if not offload:
        model = model.to(device)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model, "fsdp2"


def run_fsdp(task, *, plan, training, meter, fused: bool = False) -> None:
    """Build, wrap and train ``task`` under ``plan`` until ``meter`` stops the loop; ``fused``:
    ``AdamW(fused=True)`` (``--optimizer-impl torch-fused``) instead of torch's default choice."""
    import torch.distributed as dist

    device = device_for_rank()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if training.optimizer not in ("adamw", "adam"):
        raise SpecError(f"backend fsdp builds AdamW only; optimizer {training.optimizer!r} is not supported")
    model = task.build_model()
    blocks = task_blocks(task, model)
    apply_checkpointing(blocks, plan.checkpointing)
    model, kind = wrap_model(model, blocks=blocks, plan=plan, precision=training.precision, device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    if plan.stage == 1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=task.lr, **({"fused": True} if fused else {}))
    else:
        optimizer = torch.optim.AdamW(params, lr=task.lr, **({"fused": True} if fused else {}))
    dtype = _DTYPES[training.precision]
    autocast = (
        (lambda: torch.autocast(device.type, dtype=dtype))
        if kind in ("ddp", "single") and _mixed(training.precision)
        else contextlib.nullcontext
    )
    rank = dist.get_rank()
    accum = plan.gradient_accumulation_steps
    meter.samples_per_step = plan.micro_batch * accum * dist.get_world_size()
    meter.grad_accum = accum
    meter.start()
    step = 0
    while True:
        for micro in range(accum):
            last = micro == accum - 1
            if kind == "fsdp2":
                model.set_requires_gradient_sync(last)
                sync = contextlib.nullcontext()
            else:
                sync = contextlib.nullcontext() if last or kind == "single" else model.no_sync()
            batch = to_device(task.make_batch(plan.micro_batch, step, rank), device)
            with sync:
                with autocast():
                    loss = task.loss_fn(model, batch)
                (loss / accum).backward()
            step += 1
            if last:
                meter.before_optimizer_step()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            # Micro-step timing as the DeepSpeed wrapper does it (the boundary micro-step includes
            # the gradient reduction and the optimizer); whole optimizer steps otherwise.
            if meter.micro_mode:
                meter.micro_step_done(last)
            elif last:
                meter.optimizer_step_done()
