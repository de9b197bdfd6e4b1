"""FSDP2 settings for a plan: what ``fully_shard`` and the training loop need, as JSON. Stdlib only.

The mapping is the one the probe runtime runs (zeroplan/runtime/rank/backends/fsdp.py) and
``estimate --engine fsdp`` models: stage 0 → DDP, 1 → DDP + ZeroRedundancyOptimizer, 2 →
``fully_shard(reshard_after_forward=False)``, 3 → ``fully_shard(reshard_after_forward=True)``,
each transformer block then the root; ``MixedPrecisionPolicy(param_dtype=bf16|fp16,
reduce_dtype=fp32)``; CPU offload → ``CPUOffloadPolicy(pin_memory=True)`` (parameters, gradients
and the optimizer step on the host, stages 2–3 only). Precision ``bf16-pure``: the model cast to
bf16 before wrapping (``model_dtype``), no policy, no autocast. One process at stages 0–1: the
bare module (``engine: single``), no DDP.
"""

from __future__ import annotations

from zeroplan.spec import Plan, SpecError, TrainingSpec

__all__ = ["fsdp_settings"]

_DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": "torch.float32", "bf16-pure": "torch.bfloat16"}


def fsdp_settings(plan: Plan, training: TrainingSpec, *, world_size: int, optimizer_impl: str | None = None) -> dict:
    """The PyTorch-engine settings of ``plan`` (SpecError for what PyTorch's engines lack);
    ``optimizer_impl="torch-fused"`` writes ``fused: true`` (``AdamW(fused=True)``)."""
    from zeroplan.estimator.fsdp import check_fsdp_plan

    check_fsdp_plan(plan)
    mixed = training.precision in ("bf16", "fp16")
    model_dtype = "torch.bfloat16" if training.precision == "bf16-pure" else "torch.float32"
    batch = {
        "micro_batch_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "global_batch": plan.micro_batch * plan.gradient_accumulation_steps * world_size,
    }
    checkpointing = {"mode": plan.checkpointing}
    if plan.checkpointing == "selective-op":
        checkpointing["how"] = ("torch.utils.checkpoint with context_fn=create_selective_checkpoint_contexts(policy): "
                                "save SDPA outputs and every other aten.mm (torchtitan's policy)")
    elif plan.checkpointing != "none":
        checkpointing["how"] = "torch.utils.checkpoint(block, use_reentrant=False) per transformer block"
    optimizer = {"type": "torch.optim.AdamW" if training.optimizer in ("adamw", "adam") else training.optimizer,
                 "note": "foreach (the CUDA default) allocates one fp32 copy of the partition in step(); fused=True none"}
    if optimizer_impl is not None:
        from zeroplan.estimator.optimizer import resolve_optimizer_impl

        resolve_optimizer_impl(optimizer_impl, engine="fsdp", plan=plan)
        paged = {"bnb-paged": "bitsandbytes.optim.PagedAdamW", "bnb-paged-8bit": "bitsandbytes.optim.PagedAdamW8bit"}
        if optimizer_impl in paged and training.optimizer in ("adamw", "adam"):
            optimizer = {"type": paged[optimizer_impl],
                         "note": "states of tensors >= 1e5 elements in CUDA unified memory (paged to host RAM when the GPU is full)"}
        else:
            optimizer["fused"] = optimizer_impl == "torch-fused"
    if training.optimizer_in_backward:
        optimizer["in_backward"] = ("one optimizer per parameter, stepped in register_post_accumulate_grad_hook and "
                                    "its gradient freed there (torchtune optimizer_in_bwd)")
    if plan.stage <= 1:
        single = world_size == 1
        engine = {
            "wrapper": None if single else "torch.nn.parallel.DistributedDataParallel",
            "model_dtype": model_dtype,
            "autocast": _DTYPES[training.precision] if mixed else None,
        }
        if plan.stage == 1:
            optimizer["wrapper"] = "torch.distributed.optim.ZeroRedundancyOptimizer"
        return {"engine": "single" if single else "ddp", **engine, "batch": batch, "activation_checkpointing": checkpointing,
                "optimizer": optimizer}
    offload = plan.offload_optimizer == "cpu" or plan.offload_param == "cpu"
    if plan.stage == 3 and offload and plan.offload_param != "cpu":
        raise SpecError("FSDP2's CPUOffloadPolicy offloads parameters too: at stage 3 give --offload-param cpu with --offload-optimizer cpu")
    return {
        "engine": "fsdp2",
        "model_dtype": model_dtype,
        "fully_shard": {
            "apply_to": "each transformer block, then the root module",
            "reshard_after_forward": plan.stage == 3,
            "mp_policy": {"param_dtype": _DTYPES[training.precision], "reduce_dtype": "torch.float32"} if mixed else None,
            "offload_policy": "CPUOffloadPolicy(pin_memory=True)" if offload else None,
        },
        "batch": batch,
        "activation_checkpointing": checkpointing,
        "optimizer": optimizer,
    }
