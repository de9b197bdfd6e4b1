"""A trial's DeepSpeed config: the user's own config with only the tuned keys replaced.

DeepSpeed's autotuner starts every experiment from the user's ``--deepspeed_config`` and
overwrites the keys it tunes (deepspeed/autotuning/autotuner.py, ``_generate_experiments``);
zeroplan does the same, so optimizer, scheduler, precision, clipping and every ``"auto"`` entry
stay as the user wrote them. Without a base, a Hugging Face Trainer script gets
:data:`HF_TEMPLATE` — the shape of the configs in the transformers DeepSpeed docs, with
``"auto"`` wherever Trainer fills a value from its arguments — and a plain script gets zeroplan's
complete config (:func:`zeroplan.dsconfig.build_config`).
"""

from __future__ import annotations

import copy
from typing import Optional

from zeroplan.dsconfig.keys import ZERO_DEFAULTS
from zeroplan.spec import Plan

__all__ = ["TUNED_TOP_LEVEL_KEYS", "TUNED_ZERO_KEYS", "HF_TEMPLATE", "apply_plan_config", "base_for_script", "with_overlap_comm"]

#: Top-level keys a plan decides (the batch shape; activation checkpointing when it checkpoints).
TUNED_TOP_LEVEL_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

#: ``zero_optimization`` keys a plan decides: the stage, where states live, and the bucket sizes.
TUNED_ZERO_KEYS = ("stage", "offload_optimizer", "offload_param", *ZERO_DEFAULTS)

#: Base for a Trainer script without ``--config``: transformers fills every ``"auto"`` from
#: TrainingArguments (integrations/deepspeed.py ``HfTrainerDeepSpeedConfig``); the optimizer block
#: makes DeepSpeed build its own optimizer (DeepSpeedCPUAdam under optimizer offload).
HF_TEMPLATE: dict = {
    "train_batch_size": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "gradient_clipping": "auto",
    # Trainer sizes these from the model's hidden_size h (h², 0.9·h², 10·h), as the estimator does;
    # left out, DeepSpeed would allocate its 5e8-element default buckets.
    "zero_optimization": {
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
}


def apply_plan_config(base: dict, plan_config: dict, plan: Plan) -> dict:
    """``base`` with the tuned keys of ``plan_config`` (the :func:`build_config` of ``plan``) written in.

    * batch keys: the plan's numbers (Trainer checks them against the flags zeroplan passes), but
      an ``"auto"`` ``train_batch_size`` stays under sequence parallelism (see below);
    * ``zero_optimization``: stage and offload blocks from the plan (an offload block the plan
      does not use is removed); a bucket size only where the plan itself sets it (``--bucket-sizes``
      tunes ``reduce_bucket_size``), so the base's own values and ``"auto"`` entries stay; every
      other ZeRO key of the base is kept;
    * ``activation_checkpointing`` from the plan when it has one;
    * the layout: ``sequence_parallel_size``, ``tensor_parallel.autotp_size`` and
      ``expert_parallel`` from the plan (:func:`_apply_layout`);
    * everything else is the base's, untouched.
    """
    cfg = copy.deepcopy(base)
    for key in TUNED_TOP_LEVEL_KEYS:
        if key == "train_batch_size" and plan.sp > 1 and base.get(key) == "auto":
            # Under Ulysses the Trainer cannot be given the number: it checks train_batch_size
            # against world × micro × accumulation (transformers integrations/deepspeed.py
            # trainer_config_process, fill_match; measured: "ds train_batch_size=64 vs hf
            # train_batch_size (calculated)=128" at sp 2 on 2 ranks), and accelerate rewrites it
            # to micro × accumulation × dp before deepspeed.initialize (accelerator.py
            # _prepare_deepspeed, "fix it at the last moment"). Left "auto", both agree.
            continue
        cfg[key] = plan_config[key]
    zero = cfg.get("zero_optimization")
    zero = dict(zero) if isinstance(zero, dict) else {}
    planned = plan_config.get("zero_optimization") or {}
    zero["stage"] = planned.get("stage", 0)
    for block in ("offload_optimizer", "offload_param"):
        if block in planned:
            # The device is tuned; the user's other offload settings (pin_memory, buffers) stay.
            user = zero.get(block) if isinstance(zero.get(block), dict) else {}
            merged = {**planned[block], **user, "device": planned[block]["device"]}
            if "nvme_path" in planned[block]:
                merged["nvme_path"] = planned[block]["nvme_path"]
            zero[block] = merged
        else:
            zero.pop(block, None)
    for key in ZERO_DEFAULTS:
        if getattr(plan, key, None) is not None and key in planned:
            zero[key] = planned[key]
    cfg["zero_optimization"] = zero
    if "activation_checkpointing" in plan_config:
        cfg["activation_checkpointing"] = plan_config["activation_checkpointing"]
    _apply_layout(cfg, plan_config, plan)
    return cfg


def _apply_layout(cfg: dict, plan_config: dict, plan: Plan) -> None:
    """Write ``plan``'s layout into ``cfg`` (in place) as ``plan_config`` has it.

    The degrees are the plan's as much as the batch is: the batch keys above count
    micro × accumulation × world/sp (zeroplan.dsconfig.layout_keys), DeepSpeed reads Ulysses'
    degree from ``sequence_parallel_size`` (runtime/config.py) and AutoTP's from
    ``tensor_parallel.autotp_size``, and a Trainer rank turns Ulysses on from the config's
    ``sequence_parallel_size`` (zeroplan.runtime.rank.layout.environment_for). A base without
    them ran an sp/tp trial as data parallelism under the layout's batch (the label said sp2).
    A degree the plan does not use is removed from the base; the user's other ``tensor_parallel``
    and ``expert_parallel`` settings stay beside the plan's degree.
    """
    if plan.sp > 1:
        cfg["sequence_parallel_size"] = plan_config["sequence_parallel_size"]
    else:
        cfg.pop("sequence_parallel_size", None)
    for block, degree, used in (("tensor_parallel", "autotp_size", plan.tp > 1), ("expert_parallel", "autoep_size", plan.ep > 1)):
        user = cfg.get(block) if isinstance(cfg.get(block), dict) else {}
        if used:
            cfg[block] = {**user, **plan_config[block]}
        elif block in cfg:
            rest = {k: v for k, v in user.items() if k not in (degree, "enabled")}
            if rest:
                cfg[block] = rest
            else:
                cfg.pop(block)


def base_for_script(base: Optional[dict], *, trainer: bool) -> Optional[dict]:
    """The base a trial starts from: the user's config, else the HF template for a Trainer script,
    else None (zeroplan's complete config is used as is)."""
    if base is not None:
        return base
    return copy.deepcopy(HF_TEMPLATE) if trainer else None


def with_overlap_comm(base: Optional[dict], overlap_comm: bool) -> Optional[dict]:
    """``base`` with ``zero_optimization.overlap_comm`` set (``tune --overlap-comm``), so every
    trial's config runs what the plans were estimated with: :func:`apply_plan_config` keeps the
    base's ZeRO keys it does not tune, and without the key DeepSpeed runs its default (true at
    stage 3 only; runtime/zero/config.py ``overlap_comm_valid``). None stays None (the trial's
    config is then the plan's own, which carries ``overlap_comm``)."""
    if base is None:
        return None
    cfg = copy.deepcopy(base)
    zero = cfg.get("zero_optimization")
    cfg["zero_optimization"] = {**(zero if isinstance(zero, dict) else {}), "overlap_comm": overlap_comm}
    return cfg
