"""Plan → a complete DeepSpeed JSON config, right by construction.

The batch keys are consistent for the given world size, every integer DeepSpeed's pydantic
models want is an ``int``, offload blocks appear only where DeepSpeed honours them, numbers are
numbers, and bucket sizes follow the model's hidden size when it is known.
"""

from __future__ import annotations

from zeroplan.dsconfig.keys import ZERO_DEFAULTS
from zeroplan.spec import ModelSpec, Plan, SpecError, TrainingSpec, resolve_engine_knobs
from zeroplan.spec.moe import DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES

__all__ = ["build_config", "build_config_with_notes", "resolve_buckets", "DEEPSPEED_OPTIMIZER_TYPES"]

#: zeroplan optimizer name → the ``optimizer.type`` DeepSpeed understands. ``Adafactor`` is not
#: one of DeepSpeed's own optimizers; DeepSpeed looks any other name up as
#: ``getattr(torch.optim, type)`` (deepspeed/runtime/engine.py ``_configure_basic_optimizer``),
#: and torch >= 2.5 ships ``torch.optim.Adafactor``, so the name works as written.
DEEPSPEED_OPTIMIZER_TYPES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD", "lion": "Lion", "adafactor": "Adafactor"}

#: Optimizers ZeRO (stage >= 1) refuses unless ``zero_allow_untested_optimizer`` is true
#: (deepspeed/runtime/zero/utils.py ``ZERO_SUPPORTED_OPTIMIZERS`` has no SGD or Adafactor).
_UNTESTED_UNDER_ZERO = ("sgd", "adafactor")


def resolve_buckets(plan: Plan, model: ModelSpec | None) -> dict[str, int]:
    """The ZeRO bucket and threshold sizes (in elements) a plan runs with.

    Precedence: a value set on the plan; else, when the model's hidden size h is known, the rule
    Hugging Face's DeepSpeed integration applies to ``"auto"`` values
    (transformers/integrations/deepspeed.py ``HfTrainerDeepSpeedConfig.trainer_config_finalize``:
    reduce bucket h², stage-3 prefetch ``int(0.9·h²)``, persistence threshold 10·h); else
    DeepSpeed's own defaults (deepspeed/runtime/zero/config.py ``DeepSpeedZeroConfig``:
    reduce and all-gather buckets 5e8, prefetch 5e7, persistence 1e5, max live parameters and
    max reuse distance 1e9).
    """
    # One rule for the estimator and the exported config: zeroplan.spec.resolve_engine_knobs.
    knobs = resolve_engine_knobs(
        plan, model.hidden_size if model is not None else None,
        trainable_params=model.trainable_params if model is not None and model.peft else None,
    )
    return {key: knobs[key] for key in ZERO_DEFAULTS}


def _precision_blocks(precision: str) -> dict:
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        # DeepSpeed's documented defaults for dynamic loss scaling (runtime/precision_config.py
        # DeepSpeedFP16Config): loss_scale 0 = dynamic, start at 2^16, double after 1000 clean
        # steps, halve after 2 overflows in a row, never below 1.
        return {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 16,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        }
    return {}


def _offload_block(device: str, nvme_path: str | None) -> dict:
    block: dict = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = nvme_path
    return block


def _optimizer_block(optimizer: str, *, lr: float, weight_decay: float) -> dict:
    kind = DEEPSPEED_OPTIMIZER_TYPES[optimizer]
    if optimizer in ("adamw", "adam"):
        params: dict = {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": weight_decay}
        if optimizer == "adam":
            # DeepSpeed runs type "Adam" as AdamW unless adam_w_mode is false
            # (runtime/engine.py: ADAM_W_MODE_DEFAULT = True).
            params["adam_w_mode"] = False
    elif optimizer == "sgd":
        params = {"lr": lr, "momentum": 0.9, "weight_decay": weight_decay}
    elif optimizer == "lion":
        # Lion's recommended betas (Chen et al. 2023, arXiv 2302.06675, §5).
        params = {"lr": lr, "betas": [0.9, 0.99], "weight_decay": weight_decay}
    else:
        params = {"lr": lr, "weight_decay": weight_decay}
    return {"type": kind, "params": params}


def _scheduler_block(*, lr: float, warmup_steps: int, total_steps: int | None) -> dict:
    params: dict = {"warmup_min_lr": 0.0, "warmup_max_lr": lr, "warmup_num_steps": warmup_steps, "warmup_type": "linear"}
    if total_steps is None:
        return {"type": "WarmupLR", "params": params}
    params["total_num_steps"] = total_steps
    return {"type": "WarmupDecayLR", "params": params}


def _zero_block(plan: Plan, buckets: dict[str, int], nvme_path: str | None) -> dict:
    zero: dict = {"stage": plan.stage}
    if plan.stage == 0:
        return zero
    zero.update({"overlap_comm": plan.overlap_comm, "contiguous_gradients": True,
                 "reduce_bucket_size": buckets["reduce_bucket_size"]})
    if plan.stage in (1, 2):
        zero["reduce_scatter"] = True
        zero["allgather_bucket_size"] = buckets["allgather_bucket_size"]
    else:
        for key in (
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        ):
            zero[key] = buckets[key]
        zero["stage3_gather_16bit_weights_on_model_save"] = True
        # ZeRO++ (arXiv 2306.10209), DeepSpeed's zero_optimization keys (runtime/zero/config.py).
        if plan.zero_hpz_partition_size > 1:
            zero["zero_hpz_partition_size"] = plan.zero_hpz_partition_size
        if plan.zero_quantized_weights:
            zero["zero_quantized_weights"] = True
        if plan.zero_quantized_gradients:
            zero["zero_quantized_gradients"] = True
    if plan.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload_block(plan.offload_optimizer, nvme_path)
    if plan.offload_param != "none":
        zero["offload_param"] = _offload_block(plan.offload_param, nvme_path)
    return zero


def _leaf_module_block(plan: Plan, model: ModelSpec | None) -> dict:
    """``zero_optimization.leaf_module`` for a ZeRO-3 plan of a model with ModuleList-expert MoE
    blocks: DeepSpeed's default classes (which a given ``classes`` list replaces,
    runtime/zero/leaf_module_config.py) followed by the model's; {} when none is needed."""
    if plan.stage != 3 or model is None or model.moe is None or not model.moe.leaf_module_classes:
        return {}
    return {"classes": list(dict.fromkeys(DEEPSPEED_DEFAULT_LEAF_MODULE_CLASSES + model.moe.leaf_module_classes))}


def build_config_with_notes(
    plan: Plan,
    *,
    world_size: int,
    training: TrainingSpec,
    model: ModelSpec | None = None,
    lr: float = 1e-4,
    weight_decay: float = 0.01,
    gradient_clipping: float = 1.0,
    warmup_steps: int = 100,
    total_steps: int | None = None,
    nvme_path: str | None = None,
    optimizer_impl: str | None = None,
) -> tuple[dict, list[str]]:
    """:func:`build_config` plus the notes a user should read alongside the config."""
    import math

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise SpecError(f"world_size={world_size!r} is not valid; give the number of GPUs, >= 1")
    for name, value in (("lr", lr), ("weight_decay", weight_decay), ("gradient_clipping", gradient_clipping)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise SpecError(f"{name}={value!r} is not valid; give a finite number >= 0")
    if lr == 0:
        raise SpecError("lr=0 would never update the model; give a positive learning rate such as 1e-4")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise SpecError(f"warmup_steps={warmup_steps!r} is not valid; give a whole number >= 0")
    if total_steps is not None and (not isinstance(total_steps, int) or total_steps <= warmup_steps):
        raise SpecError(f"total_steps={total_steps!r} must be a whole number larger than warmup_steps={warmup_steps}")
    uses_nvme = "nvme" in (plan.offload_optimizer, plan.offload_param)
    if uses_nvme and not nvme_path:
        raise SpecError("NVMe offload needs a directory on the NVMe drive; give --nvme-path /local_nvme")
    if not uses_nvme and nvme_path:
        raise SpecError(f"--nvme-path {nvme_path} is only used with --offload-optimizer nvme or --offload-param nvme")

    from zeroplan.dsconfig.layout_keys import batch_world_size, layout_keys

    # With sp/tp the batch assertion's world is world/sp and the samples per step micro × accumulation × dp
    # (zeroplan.dsconfig.layout_keys); pure data parallelism: both are the GPU count.
    train_batch_size = plan.micro_batch * plan.gradient_accumulation_steps * batch_world_size(plan, world_size)
    samples = plan.micro_batch * plan.gradient_accumulation_steps * plan.data_parallel(world_size)
    if training.global_batch is not None and training.global_batch != samples:
        ranks = "gpus" if plan.model_parallel == 1 else "data-parallel ranks"
        raise SpecError(
            f"global_batch={training.global_batch} != micro_batch×grad_accum×{ranks} = {plan.micro_batch}×"
            f"{plan.gradient_accumulation_steps}×{plan.data_parallel(world_size)} = {samples}; change one of them"
        )

    notes: list[str] = []
    buckets = resolve_buckets(plan, model)
    if model is None and plan.stage > 0:
        notes.append("bucket sizes are DeepSpeed's defaults; give --model or --params to size them from the hidden size")
    cfg: dict = {
        # DeepSpeed asserts train_batch_size == micro × accumulation × world size
        # (runtime/config.py _batch_assertion).
        "train_batch_size": train_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "gradient_clipping": float(gradient_clipping),
        "steps_per_print": 100,
        **layout_keys(plan),
    }
    from zeroplan.estimator.plans import check_engine_precision

    check_engine_precision("deepspeed", training.precision)
    cfg.update(_precision_blocks(training.precision))
    cfg["zero_optimization"] = _zero_block(plan, buckets, nvme_path)
    leaf = _leaf_module_block(plan, model)
    if leaf:
        cfg["zero_optimization"]["leaf_module"] = leaf
        notes.append(
            f"zero_optimization.leaf_module lists {', '.join(model.moe.leaf_module_classes)}: their experts are an "
            "nn.ModuleList, which ZeRO-3 must fetch whole (validate rule ZP250)"
        )
    if plan.ep > 1:
        # DeepSpeed AutoEP (module_inject/auto_ep_config.py parse_autoep_config): it finds the MoE
        # blocks itself (presets by model type) and splits each layer's experts over autoep_size ranks.
        cfg["expert_parallel"] = {"enabled": True, "autoep_size": plan.ep}
        notes.append(
            f"expert_parallel: AutoEP splits each MoE layer's experts over {plan.ep} ranks; DeepSpeed groups the "
            "expert parameters itself when the config's optimizer builds them (runtime/engine.py configure_moe_param_groups)"
        )
    cfg["optimizer"] = _optimizer_block(training.optimizer, lr=float(lr), weight_decay=float(weight_decay))
    if optimizer_impl is not None:
        from zeroplan.estimator.optimizer import resolve_optimizer_impl

        resolve_optimizer_impl(optimizer_impl, engine="deepspeed", plan=plan)
        if optimizer_impl in ("torch", "torch-forloop", "torch-fused"):
            if training.optimizer not in ("adam", "adamw"):
                raise SpecError(f"optimizer_impl={optimizer_impl!r} selects torch's Adam/AdamW; the optimizer is {training.optimizer}")
            cfg["optimizer"]["params"]["torch_adam"] = True
            if optimizer_impl == "torch-fused":
                cfg["optimizer"]["params"]["fused"] = True
            elif optimizer_impl == "torch-forloop":
                # DeepSpeed 0.19.8 runtime/engine.py:2378-2382 pops torch_adam and passes foreach to torch.optim.AdamW.
                cfg["optimizer"]["params"]["foreach"] = False
    cfg["scheduler"] = _scheduler_block(lr=float(lr), warmup_steps=warmup_steps, total_steps=total_steps)
    if plan.stage > 0 and training.optimizer in _UNTESTED_UNDER_ZERO:
        cfg["zero_allow_untested_optimizer"] = True
        notes.append(
            f"{DEEPSPEED_OPTIMIZER_TYPES[training.optimizer]} is not on ZeRO's tested-optimizer list; "
            "zero_allow_untested_optimizer is set so DeepSpeed accepts it"
        )
    if training.optimizer == "adafactor":
        notes.append("Adafactor is torch.optim.Adafactor (torch >= 2.5), which DeepSpeed builds by name")
    if plan.offload_optimizer != "none" and training.optimizer in ("sgd", "adafactor"):
        notes.append(
            f"with offload_optimizer, {DEEPSPEED_OPTIMIZER_TYPES[training.optimizer]} runs as a plain torch "
            "optimizer on the CPU (DeepSpeed has fast CPU kernels only for Adam/AdamW, Adagrad and Lion)"
        )
    if plan.checkpointing != "none":
        cfg["activation_checkpointing"] = {
            "partition_activations": False,
            "cpu_checkpointing": plan.cpu_checkpointing,
            "contiguous_memory_optimization": False,
            "synchronize_checkpoint_boundary": False,
        }
        notes.append(
            "activation_checkpointing configures deepspeed.checkpointing; the model must still wrap its "
            "blocks in checkpoint() (e.g. Hugging Face: model.gradient_checkpointing_enable())"
        )
    return cfg, notes


def build_config(
    plan: Plan,
    *,
    world_size: int,
    training: TrainingSpec,
    model: ModelSpec | None = None,
    lr: float = 1e-4,
    weight_decay: float = 0.01,
    gradient_clipping: float = 1.0,
    warmup_steps: int = 100,
    total_steps: int | None = None,
    nvme_path: str | None = None,
    optimizer_impl: str | None = None,
) -> dict:
    """A complete DeepSpeed config for ``plan`` on ``world_size`` data-parallel GPUs.

    * Batch keys: ``train_batch_size = micro × accumulation × world_size`` exactly.
    * ``bf16`` or ``fp16`` (dynamic loss scaling with DeepSpeed's defaults) from
      ``training.precision``; neither block for fp32.
    * ``zero_optimization``: the plan's stage; bucket sizes from :func:`resolve_buckets` (ints);
      ``offload_optimizer``/``offload_param`` only when the plan offloads (the Plan already
      refuses combinations DeepSpeed ignores); ``nvme_path`` only for NVMe, and required then.
    * ``optimizer`` (AdamW, Adam with ``adam_w_mode: false``, SGD, Lion, or torch's Adafactor)
      and a WarmupLR scheduler (WarmupDecayLR when ``total_steps`` is given), numbers as numbers.
      ``optimizer_impl`` (Adam/AdamW only) says who runs the step: ``deepspeed-fused`` /
      ``deepspeed-cpu`` (or None) leave the choice to DeepSpeed (FusedAdam, CPU Adam with
      offload); ``torch`` sets ``torch_adam: true`` (DeepSpeed builds ``torch.optim.AdamW``,
      runtime/engine.py ``get_optimizer_configuration``) and ``torch-fused`` adds ``fused: true``,
      which DeepSpeed passes on to it.
    * ``activation_checkpointing`` when the plan checkpoints.

    Raises SpecError for inconsistent input (a global batch that disagrees, NVMe without a path).
    """
    cfg, _ = build_config_with_notes(
        plan,
        world_size=world_size,
        training=training,
        model=model,
        lr=lr,
        weight_decay=weight_decay,
        gradient_clipping=gradient_clipping,
        warmup_steps=warmup_steps,
        total_steps=total_steps,
        nvme_path=nvme_path,
        optimizer_impl=optimizer_impl,
    )
    return cfg
