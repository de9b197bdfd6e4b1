"""The optimizer's implementation and what its step allocates beyond its states. Stdlib only.

Which implementation runs decides the step's temporaries: torch.optim's foreach AdamW allocates
a partition-sized fp32 buffer, DeepSpeed's FusedAdam and CPU Adam none. Sources per function.
"""

from __future__ import annotations

from typing import Optional

from zeroplan.spec import Plan, SpecError
from zeroplan.spec.engines import TORCH_ENGINES

__all__ = [
    "OPTIMIZER_IMPLS", "TORCH_IMPLS", "PAGED_IMPLS", "ENGINE_OPTIMIZER_IMPLS", "default_optimizer_impl", "resolve_optimizer_impl",
    "optimizer_step_temporaries", "paged_state_bytes",
]

#: Optimizer implementations zeroplan models: torch.optim with its default choice (``torch``:
#: foreach on CUDA, the for-loop on CPU), torch.optim forced to its for-loop (``torch-forloop``:
#: ``foreach=False``, torch < 2.0's default, or a tensor learning rate), its fused kernel
#: (``torch-fused``), DeepSpeed's FusedAdam (``deepspeed-fused``) and CPU Adam (``deepspeed-cpu``),
#: and bitsandbytes' paged AdamW with 32-bit states (``bnb-paged``: ``PagedAdamW``,
#: ``PagedAdamW32bit``, Hugging Face's ``optim=paged_adamw_32bit``) or 8-bit states
#: (``bnb-paged-8bit``: ``PagedAdamW8bit``, ``paged_adamw_8bit``): :func:`paged_state_bytes`.
OPTIMIZER_IMPLS = ("torch", "torch-forloop", "torch-fused", "deepspeed-fused", "deepspeed-cpu", "bnb-paged", "bnb-paged-8bit")
#: bitsandbytes' paged implementations (states in CUDA unified memory).
PAGED_IMPLS = ("bnb-paged", "bnb-paged-8bit")
#: The implementations that are torch.optim's Adam/AdamW (DeepSpeed's ``torch_adam`` path).
TORCH_IMPLS = ("torch", "torch-forloop", "torch-fused")



def optimizer_step_temporaries(
    *, impl: str, optimizer: str, partition_params: int, largest_param: int, state_bytes: int = 4, on_gpu: bool = True
) -> dict[str, int]:
    """Bytes an optimizer allocates only inside ``step()``, beyond its states, by item.

    ``partition_params``: parameters this rank updates; ``largest_param``: its largest tensor.
    Under DeepSpeed ZeRO 1-2 a client optimizer's parameter group holds one tensor, the rank's
    flat fp32 partition (stage_1_and_2.py ``single_partition_of_fp32_groups``; stage 3 one per
    sub-group), so there the largest tensor *is* the partition.

    Which path torch's Adam/AdamW runs (torch 2.13, torch/optim/adam.py:933-948, ``adam()``):
    with neither ``foreach`` nor ``fused`` given, ``_default_to_fused_or_foreach``
    (torch/optim/optimizer.py:161-186) picks foreach when every parameter is a plain tensor on a
    foreach device (CUDA), and the for-loop otherwise (CPU) — or when ``lr`` is a tensor and
    ``capturable`` is off (adam.py:943-944). torch < 2.0 defaulted to the for-loop everywhere.
    Hugging Face's Trainer (transformers 5.24, trainer_optimizer.py:200-208 ``_get_adamw_torch``)
    builds ``torch.optim.AdamW`` with no ``foreach`` for ``adamw_torch`` (torch's choice above) and
    ``fused=True`` for ``adamw_torch_fused``, the default ``optim`` from torch 2.8 on
    (training_args.py:805-812).

    * ``torch`` Adam/AdamW: on the GPU the foreach ``_multi_tensor_adam`` does
      ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` (adam.py:790) — one fp32
      copy of the whole partition, then divided and added in place. On CPU it is the for-loop
      (below). Measured on 2 CPU ranks (FSDP2 shards, benchmarks/fsdp_memory_timeline.py):
      exactly 4·partition (foreach) and 2·4·largest shard (for-loop).
    * ``torch-forloop`` (``_single_tensor_adam``, adam.py:544): ``denom = (exp_avg_sq.sqrt() /
      bias_correction2_sqrt).add_(eps)``: ``sqrt()`` makes one fp32 temporary of the tensor and
      the division a second while the first is alive — 2·4·largest, on the GPU as on CPU. Over
      DeepSpeed's flat partition that is two partition-sized fp32 tensors (an out-of-memory
      report naming this line is how the for-loop shows on a full GPU). Measured on 2 CPU ranks
      under DeepSpeed ZeRO 1-2 (benchmarks/results/optimizer_step_memory.txt, ``torch-loop``):
      the step allocates 26.3 MB predicted 26.4 MB.
    * ``torch-fused`` (``fused=True``, ``_fused_adam``), ``deepspeed-fused`` (FusedAdam's
      multi_tensor_adam kernel) and ``deepspeed-cpu`` (DeepSpeedCPUAdam, in place in C++):
      no tensor-sized temporaries.
    * SGD with momentum, Lion: in-place updates in torch's foreach/for-loop paths (``torch/optim/
      sgd.py``: ``_foreach_add_`` on the momentum buffers; Lion as torch AdamW's update without
      the sqrt): none. Adafactor (transformers' implementation): the factored update
      ``update = exp_avg_sq_row/col`` outer product, one fp32 tensor of the largest parameter.
    """
    if impl not in OPTIMIZER_IMPLS:
        raise SpecError(f"optimizer_impl={impl!r} is not valid; choose one of {', '.join(OPTIMIZER_IMPLS)}")
    if impl not in ("torch", "torch-forloop"):
        return {}
    if optimizer in ("adam", "adamw"):
        if impl == "torch" and on_gpu:
            return {"adam_foreach_sqrt": state_bytes * partition_params}
        return {"adam_sqrt_and_denom": 2 * state_bytes * largest_param}
    if optimizer == "adafactor":
        return {"adafactor_update": state_bytes * largest_param}
    return {}


#: Implementations each engine can run: PyTorch's engines take torch.optim optimizers; DeepSpeed
#: runs its own (config ``optimizer`` block) or a client optimizer (torch.optim, e.g. what Hugging
#: Face's Trainer creates when the config has no ``optimizer`` block).
ENGINE_OPTIMIZER_IMPLS = {
    "deepspeed": ("torch", "torch-forloop", "torch-fused", "deepspeed-fused", "deepspeed-cpu"),
    **{engine: ("torch", "torch-forloop", "torch-fused", *PAGED_IMPLS) for engine in TORCH_ENGINES},
}

#: bitsandbytes allocates a state buffer in unified memory only for tensors of at least this many
#: elements; smaller ones get ordinary device tensors (bitsandbytes 0.50.2, optim/optimizer.py:383
#: ``if not self.is_paged or p.numel() < 1e5: return torch.zeros_like(...)``).
PAGED_MIN_NUMEL = 100_000
#: 8-bit states: tensors under ``min_8bit_size`` keep fp32 states (optim/optimizer.py:502-503;
#: ``min_8bit_size=4096``, optim/adamw.py ``PagedAdamW8bit``); the others one uint8 per element
#: per moment plus one fp32 absmax per block of 256 (optim/optimizer.py:518-529).
MIN_8BIT_SIZE = 4096
BLOCKWISE_8BIT = 256


def paged_state_bytes(tensor_numels: dict[int, int], *, impl: str, optimizer: str) -> dict[str, int]:
    """Adam/AdamW state bytes of bitsandbytes' paged optimizers, split by where they live.

    ``tensor_numels`` maps a trainable tensor's element count to how many such tensors there
    are. bitsandbytes' ``Optimizer2State.init_state`` (0.50.2, optim/optimizer.py:495-529) makes
    two state buffers per tensor through ``get_state_buffer`` (:374-388): a tensor of at least
    1e5 elements gets ``F.get_paged`` — ``cget_managed_ptr``, i.e. ``cudaMallocManaged``
    (functional.py:91-99), CUDA unified memory that torch's caching allocator never sees
    (``max_memory_allocated``/``reserved`` leave it out) and the driver migrates to host RAM when
    the GPU is full; smaller tensors get ordinary ``torch.zeros_like`` device tensors.

    * ``bnb-paged`` (32-bit states, fp32 whatever the parameter's dtype): 8 bytes per element.
    * ``bnb-paged-8bit``: tensors under 4096 elements keep fp32 states (8 B); the others one
      uint8 per element per moment (2 B), paged or not by the 1e5 rule, plus two fp32 absmax
      vectors of ⌈n/256⌉ (``torch.zeros`` on the device: always torch's).

    Returns ``device_states`` (in torch's allocator), ``unified_states`` (paged) and
    ``absmax`` (device); zeros for other optimizers (bitsandbytes' paged AdamW only).
    """
    if impl not in PAGED_IMPLS or optimizer not in ("adam", "adamw"):
        return {"device_states": 0, "unified_states": 0, "absmax": 0}
    device = unified = absmax = 0
    for numel, count in tensor_numels.items():
        if impl == "bnb-paged-8bit" and numel >= MIN_8BIT_SIZE:
            per, absmax = 2 * numel, absmax + count * 2 * 4 * -(-numel // BLOCKWISE_8BIT)
        else:
            per = 8 * numel
        if numel >= PAGED_MIN_NUMEL:
            unified += count * per
        else:
            device += count * per
    return {"device_states": device, "unified_states": unified, "absmax": absmax}


def default_optimizer_impl(*, engine: str, plan: Plan, ds_config: Optional[dict] = None) -> str:
    """The implementation a run of ``plan`` uses when nobody says.

    * fsdp: ``torch`` (torch.optim.AdamW with its default foreach/for-loop choice).
    * deepspeed with an Adam block whose params say ``torch_adam: true``: ``torch`` (``torch-fused``
      with ``fused: true``).
    * deepspeed with a config that has no ``optimizer`` block: the script passes its own
      optimizer to ``deepspeed.initialize``; Hugging Face's Trainer creates torch's AdamW
      (transformers/integrations/deepspeed.py ``deepspeed_optim_sched``: "if 'optimizer' not in
      config ... optimizer = trainer.create_optimizer()"): ``torch``.
    * deepspeed otherwise: DeepSpeed builds its own (runtime/engine.py ``_configure_basic_optimizer``):
      ``DeepSpeedCPUAdam`` with optimizer offload, ``FusedAdam`` on the GPU.
    """
    if engine in TORCH_ENGINES:
        return "torch"
    if ds_config is not None and "optimizer" not in ds_config:
        return "torch"
    params = (ds_config or {}).get("optimizer", {}).get("params") if isinstance((ds_config or {}).get("optimizer"), dict) else None
    if isinstance(params, dict) and params.get("torch_adam") is True:
        # runtime/engine.py get_optimizer_configuration: torch_adam builds torch.optim.AdamW with
        # the block's other params (``fused: true`` included), before any CPU Adam choice.
        if params.get("fused") is True:
            return "torch-fused"
        return "torch-forloop" if params.get("foreach") is False else "torch"
    return "deepspeed-cpu" if plan.offload_optimizer != "none" else "deepspeed-fused"


def resolve_optimizer_impl(impl: Optional[str], *, engine: str, plan: Plan) -> str:
    """``impl`` checked against the engine and the plan, or the default; SpecError names the fix."""
    if impl is None:
        return default_optimizer_impl(engine=engine, plan=plan)
    valid = ENGINE_OPTIMIZER_IMPLS.get(engine, OPTIMIZER_IMPLS)
    if impl not in valid:
        raise SpecError(f"optimizer_impl={impl!r} does not exist for engine {engine}; choose one of {', '.join(valid)}")
    offload = plan.offload_optimizer != "none"
    if impl == "deepspeed-cpu" and not offload:
        raise SpecError("optimizer_impl='deepspeed-cpu' (DeepSpeedCPUAdam) updates host tensors: it needs --offload-optimizer cpu or nvme")
    if impl in PAGED_IMPLS and offload:
        raise SpecError(f"optimizer_impl={impl!r} pages its states to host RAM itself: it is not combined with --offload-optimizer/--offload-param")
    if impl == "deepspeed-fused" and offload:
        raise SpecError("optimizer_impl='deepspeed-fused' (FusedAdam) runs on the GPU: with optimizer offload DeepSpeed uses deepspeed-cpu")
    return impl
