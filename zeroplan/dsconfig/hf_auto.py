"""Resolve Hugging Face ``"auto"`` values in a DeepSpeed config exactly as transformers does.

transformers/integrations/deepspeed.py, ``HfTrainerDeepSpeedConfig``:

* ``trainer_config_process(args)`` (when TrainingArguments is created): batch keys, clipping,
  optimizer and ``warmup_max_lr``/``warmup_min_lr``, fp16/bf16 — each ``"auto"`` takes the
  argument's value; an explicit value that differs is a *mismatch* (Trainer refuses to start and
  lists them);
* ``trainer_config_finalize(args, model, num_training_steps)`` (when the model is known): the
  three bucket sizes from the model's ``hidden_size`` h — reduce bucket h², and at ZeRO-3 the
  prefetch bucket ``int(0.9·h²)`` and the persistence threshold 10·h — then the scheduler's
  ``total_num_steps`` and ``warmup_num_steps`` (at least 1).

accelerate's DeepSpeed plugin fills the same keys from its own arguments
(accelerate/utils/dataclasses.py ``DeepSpeedPlugin.deepspeed_config_process``) with the same
values for these keys. Stdlib only; the tests compare against transformers' own class.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from zeroplan.spec import SpecError

__all__ = [
    "TrainerArgs",
    "AutoValue",
    "ResolvedConfig",
    "resolve_hf_auto",
    "auto_keys",
    "HIDDEN_SIZE_KEYS",
    "to_hf_auto",
    "trainer_flags",
    "accelerate_yaml",
]

#: Keys transformers sizes from the model's hidden_size (trainer_config_finalize).
HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


@dataclass(frozen=True)
class TrainerArgs:
    """The TrainingArguments values ``"auto"`` entries resolve from; defaults are transformers'."""

    per_device_train_batch_size: int = 8
    """Micro-batch per rank (``--per_device_train_batch_size``)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    world_size: int = 1
    """Data-parallel ranks (TrainingArguments.world_size)."""
    learning_rate: float = 5e-5
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    fp16: bool = False
    bf16: bool = False
    fp16_full_eval: bool = False
    bf16_full_eval: bool = False
    warmup_steps: float = 0
    """Steps when >= 1, else a fraction of the training steps (TrainingArguments.get_warmup_steps)."""
    save_on_each_node: bool = False
    auto_find_batch_size: bool = False

    def __post_init__(self) -> None:
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SpecError(f"{name}={value!r} is not valid; give a whole number >= 1")

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """transformers' TrainingArguments.get_warmup_steps."""
        return int(self.warmup_steps) if self.warmup_steps >= 1 else math.ceil(num_training_steps * self.warmup_steps)


@dataclass(frozen=True)
class AutoValue:
    """One ``"auto"`` entry and what it becomes."""

    key: str
    """Dotted config path, e.g. ``optimizer.params.lr``."""
    value: Any
    """The resolved value (None when unresolved)."""
    source: str
    """Where the value comes from (a TrainingArguments field, ``hidden_size²``), or what to pass."""

    @property
    def resolved(self) -> bool:
        return self.value is not None


@dataclass(frozen=True)
class ResolvedConfig:
    """A config with its ``"auto"`` entries filled as transformers fills them."""

    config: dict
    """The config after resolution (unresolvable entries stay ``"auto"``)."""
    values: tuple[AutoValue, ...] = field(default=())
    """Each ``"auto"`` entry of the input, in transformers' order."""
    mismatches: tuple[str, ...] = field(default=())
    """Explicit values that differ from the arguments, in transformers' wording
    (``- ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=8``)."""

    @property
    def unresolved(self) -> tuple[AutoValue, ...]:
        return tuple(v for v in self.values if not v.resolved)

    @property
    def dtype(self) -> str:
        """bf16, fp16 or fp32: what Trainer trains in after resolution."""
        if _is_true(self.config, "bf16.enabled"):
            return "bf16"
        if _is_true(self.config, "fp16.enabled"):
            return "fp16"
        return "fp32"


def _node(config: dict, key: str) -> tuple[Optional[dict], str]:
    """transformers' HfDeepSpeedConfig.find_config_node: the dict holding the last component."""
    parts = key.split(".")
    node: Any = config
    for part in parts[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return None, parts[-1]
    return (node if isinstance(node, dict) else None), parts[-1]


def _get(config: dict, key: str) -> Any:
    node, last = _node(config, key)
    return None if node is None else node.get(last)


def _is_true(config: dict, key: str) -> bool:
    value = _get(config, key)
    return False if value is None else bool(value)


def auto_keys(config: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` value in ``config``."""
    found: list[str] = []
    if isinstance(config, dict):
        for key, value in config.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            if value == "auto":
                found.append(path)
            else:
                found.extend(auto_keys(value, path))
    return found


def resolve_hf_auto(
    config: dict,
    args: TrainerArgs = TrainerArgs(),
    *,
    hidden_size: Optional[int] = None,
    num_training_steps: Optional[int] = None,
) -> ResolvedConfig:
    """``trainer_config_process`` then ``trainer_config_finalize``, on a copy of ``config``.

    ``hidden_size`` (the model's) is needed only for ``"auto"`` bucket sizes and
    ``num_training_steps`` only for an ``"auto"`` scheduler step count; without them those entries
    stay ``"auto"`` and are listed in :attr:`ResolvedConfig.unresolved` with what to pass.
    """
    cfg = copy.deepcopy(config)
    values: list[AutoValue] = []
    mismatches: list[str] = []

    def fill(key: str, hf_value: Any, hf_key: str, *, must_match: bool = True, source: Optional[str] = None) -> None:
        node, last = _node(cfg, key)
        if node is None:
            return
        if node.get(last) == "auto":
            node[last] = hf_value
            values.append(AutoValue(key, hf_value, source or hf_key))
            return
        if not must_match:
            return
        ds_value = node.get(last)
        if ds_value is not None and ds_value != hf_value:
            mismatches.append(f"- ds {key}={ds_value} vs hf {hf_key}={hf_value}")

    def unresolved(key: str, why: str) -> None:
        if _get(cfg, key) == "auto":
            values.append(AutoValue(key, None, why))

    # trainer_config_process
    train_batch_size = args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps
    fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size", must_match=not args.auto_find_batch_size)
    fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    fill("train_batch_size", train_batch_size, "train_batch_size (calculated)", must_match=not args.auto_find_batch_size,
         source=f"world_size × per_device_train_batch_size × gradient_accumulation_steps = {train_batch_size}")
    fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill("scheduler.params.warmup_min_lr", 0, "warmup_min_lr", must_match=False, source="0 (not a Trainer argument)")
    fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if args.save_on_each_node:
        cfg["checkpoint"] = cfg.get("checkpoint", {})
        cfg["checkpoint"]["use_node_local_storage"] = args.save_on_each_node
    fill("fp16.enabled", args.fp16 or args.fp16_full_eval, "fp16|fp16_full_eval")
    fill("bf16.enabled", args.bf16 or args.bf16_full_eval, "bf16|bf16_full_eval")

    # trainer_config_finalize
    if any(_get(cfg, key) == "auto" for key in HIDDEN_SIZE_KEYS):
        if hidden_size is None:
            for key in HIDDEN_SIZE_KEYS:
                unresolved(key, "needs the model's hidden_size: give --model NAME|config.json, or a number in the config")
        else:
            h = hidden_size
            fill(HIDDEN_SIZE_KEYS[0], h * h, "hidden_size", must_match=False, source=f"hidden_size² = {h}²")
            if _get(cfg, "zero_optimization.stage") == 3:
                fill(HIDDEN_SIZE_KEYS[1], int(0.9 * h * h), "hidden_size", must_match=False, source=f"int(0.9 × hidden_size²), h = {h}")
                fill(HIDDEN_SIZE_KEYS[2], 10 * h, "hidden_size", must_match=False, source=f"10 × hidden_size, h = {h}")
    if num_training_steps is None:
        for key in ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"):
            unresolved(key, "needs the number of training steps: give --max-steps")
    else:
        fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    # Entries transformers does not fill stay "auto" (DeepSpeed then fails on them).
    named = {v.key for v in values}
    for key in auto_keys(cfg):
        if key not in named:
            why = ("left \"auto\": transformers fills it only at ZeRO-3" if key in HIDDEN_SIZE_KEYS[1:]
                   else "transformers does not fill this key; give a value")
            values.append(AutoValue(key, None, why))
    return ResolvedConfig(config=cfg, values=tuple(values), mismatches=tuple(mismatches))


def to_hf_auto(config: dict) -> dict:
    """A complete DeepSpeed config rewritten for Hugging Face Trainer: ``"auto"`` wherever
    :func:`resolve_hf_auto` (transformers) fills the value, so Trainer's arguments and the
    config cannot disagree; everything else (stage, offload, ZeRO options) as it was.

    The batch shape moves to Trainer's flags (:func:`trainer_flags`); bucket sizes become
    ``"auto"`` only where transformers fills them (the reduce bucket always, the two ZeRO-3 sizes
    at stage 3).
    """
    cfg = copy.deepcopy(config)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        if key in cfg:
            cfg[key] = "auto"
    for name in ("bf16", "fp16"):
        if isinstance(cfg.get(name), dict):
            cfg[name]["enabled"] = "auto"
    params = (cfg.get("optimizer") or {}).get("params")
    if isinstance(params, dict):
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in params:
                params[key] = "auto"
    sched = (cfg.get("scheduler") or {}).get("params")
    if isinstance(sched, dict):
        for key in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps"):
            if key in sched:
                sched[key] = "auto"
    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict):
        keys = HIDDEN_SIZE_KEYS if zero.get("stage") == 3 else HIDDEN_SIZE_KEYS[:1]
        for key in keys:
            leaf = key.split(".")[-1]
            if leaf in zero:
                zero[leaf] = "auto"
    return cfg


def trainer_flags(config: dict) -> list[str]:
    """The TrainingArguments flags that make Trainer fill :func:`to_hf_auto`'s ``"auto"`` entries
    with ``config``'s values (batch shape, precision, learning rate, clipping, optimizer, warm-up)."""
    flags = [
        "--per_device_train_batch_size", str(config["train_micro_batch_size_per_gpu"]),
        "--gradient_accumulation_steps", str(config["gradient_accumulation_steps"]),
    ]
    for name in ("bf16", "fp16"):
        if _is_true(config, f"{name}.enabled"):
            flags.append(f"--{name}")
    params = (config.get("optimizer") or {}).get("params") or {}
    if "lr" in params:
        flags += ["--learning_rate", repr(params["lr"])]
    if "weight_decay" in params:
        flags += ["--weight_decay", repr(params["weight_decay"])]
    if "betas" in params:
        flags += ["--adam_beta1", repr(params["betas"][0]), "--adam_beta2", repr(params["betas"][1])]
    if "eps" in params:
        flags += ["--adam_epsilon", repr(params["eps"])]
    if "gradient_clipping" in config:
        flags += ["--max_grad_norm", repr(config["gradient_clipping"])]
    sched = (config.get("scheduler") or {}).get("params") or {}
    if "warmup_num_steps" in sched:
        flags += ["--warmup_steps", str(sched["warmup_num_steps"])]
    if "total_num_steps" in sched:
        flags += ["--max_steps", str(sched["total_num_steps"])]
    return flags


def accelerate_yaml(deepspeed_config_file: str, *, num_processes: int, num_machines: int = 1, zero3_init: bool = False,
                    parallelism: dict | None = None) -> str:
    """An accelerate config (``accelerate launch --config_file``) that runs DeepSpeed with
    ``deepspeed_config_file``; accelerate then takes batch, precision and clipping from that file
    (accelerate/utils/dataclasses.py ``DeepSpeedPlugin``). ``parallelism``: the ``parallelism_config``
    entries (:func:`zeroplan.dsconfig.layout_keys.accelerate_parallelism_entries`), which ``accelerate
    launch`` exports as ``PARALLELISM_CONFIG_*`` for ``ParallelismConfig`` to read."""
    block = []
    if parallelism:
        block = ["parallelism_config:"] + [f"  {k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in parallelism.items()]
    return "\n".join(
        [
            "compute_environment: LOCAL_MACHINE",
            "distributed_type: DEEPSPEED",
            "deepspeed_config:",
            f"  deepspeed_config_file: {deepspeed_config_file}",
            f"  zero3_init_flag: {'true' if zero3_init else 'false'}",
            "machine_rank: 0",
            "main_training_function: main",
            f"num_machines: {num_machines}",
            f"num_processes: {num_processes}",
            *block,
            "rdzv_backend: static",
            "same_network: true",
            "use_cpu: false",
            "",
        ]
    )
