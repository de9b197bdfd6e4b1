"""DeepSpeed config for a probe of a plan: ``zeroplan.dsconfig.build_config`` when available,
else the minimal config that DeepSpeed's own parser accepts for the plan (keys as in
deepspeed/runtime/config.py and deepspeed/runtime/zero/config.py)."""

from __future__ import annotations

from zeroplan.spec import ModelSpec, Plan, TrainingSpec

__all__ = ["config_for_plan", "minimal_config"]


def minimal_config(plan: Plan, training: TrainingSpec, *, world_size: int) -> dict:
    """Batch shape, precision, AdamW and the ZeRO section of ``plan``; engine knobs at DeepSpeed's defaults."""
    config: dict = {
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "train_batch_size": plan.micro_batch * plan.gradient_accumulation_steps * world_size,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": plan.stage},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if training.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif training.precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    zero = config["zero_optimization"]
    if plan.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": plan.offload_optimizer}
    if plan.offload_param != "none":
        zero["offload_param"] = {"device": plan.offload_param}
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                "stage3_param_persistence_threshold", "stage3_max_live_parameters", "stage3_max_reuse_distance"):
        value = getattr(plan, key)
        if value is not None and (plan.stage == 3 or not key.startswith("stage3")):
            zero[key] = value
    return config


def config_for_plan(plan: Plan, training: TrainingSpec, *, world_size: int, model: ModelSpec | None = None) -> dict:
    """The config zeroplan exports for ``plan`` (zeroplan.dsconfig), or :func:`minimal_config`."""
    try:
        from zeroplan.dsconfig import build_config
    except ImportError:
        return minimal_config(plan, training, world_size=world_size)
    return build_config(plan, training, world_size=world_size, model=model)
