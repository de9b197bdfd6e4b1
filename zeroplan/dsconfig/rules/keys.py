"""Validation rules ZP5xx: keys — unknown, removed, duplicated, ``"auto"``, hjson syntax, block types."""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig import keys as K
from zeroplan.dsconfig.rules import _f, _fmt, _is_int_value, _nearest, Context, Finding, rule
from zeroplan.dsconfig.rules.types import _walk


_BLOCKS = (
    # (path, valid keys, severity): pydantic blocks forbid extra keys → error; dict.get blocks ignore them → warning.
    ("zero_optimization", K.ZERO_KEYS, "error"),
    ("zero_optimization.offload_param", K.OFFLOAD_PARAM_KEYS, "error"),
    ("zero_optimization.offload_optimizer", K.OFFLOAD_OPTIMIZER_KEYS, "error"),
    ("fp16", K.FP16_KEYS, "error"),
    ("bf16", K.BF16_KEYS, "error"),
    ("activation_checkpointing", K.ACTIVATION_CHECKPOINTING_KEYS, "warning"),
    ("optimizer", K.OPTIMIZER_BLOCK_KEYS, "warning"),
    ("scheduler", K.SCHEDULER_BLOCK_KEYS, "warning"),
)


def _get_path(cfg: dict, path: str) -> object:
    node: object = cfg
    for part in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


@rule(
    "ZP501", "error", "Unknown key",
    "Inside zero_optimization, offload blocks, fp16 and bf16 DeepSpeed's pydantic models reject unknown keys; "
    "at the top level and in other blocks a misspelt key is silently ignored, so the setting never applies.",
)
def _unknown_keys(ctx: Context) -> Iterator[Finding]:
    removed = set(K.REMOVED_TOP_LEVEL_KEYS)
    for key in ctx.cfg:
        if key not in K.TOP_LEVEL_KEYS and key not in removed:
            near = _nearest(key, K.TOP_LEVEL_KEYS)
            yield _f("ZP501", key, f"unknown top-level key {key!r}: DeepSpeed ignores it",
                     f"rename it to {near!r}" if near else "remove it (check the spelling against the DeepSpeed config docs)",
                     severity="warning")
    for path, valid, severity in _BLOCKS:
        block = _get_path(ctx.cfg, path)
        if not isinstance(block, dict):
            continue
        for key in block:
            if key in valid or (path == "zero_optimization" and key in K.REMOVED_ZERO_KEYS):
                continue
            near = _nearest(key, valid)
            effect = "DeepSpeed rejects it" if severity == "error" else "DeepSpeed ignores it"
            yield _f("ZP501", f"{path}.{key}", f"unknown key {key!r} in {path}: {effect}",
                     f"rename it to {near!r}" if near else f"remove it; valid keys: {', '.join(sorted(valid)[:12])}, ...",
                     severity=severity)


@rule(
    "ZP502", "error", "Key of a removed DeepSpeed feature",
    "DeepSpeed 0.19 raises DeepSpeedConfigError for blocks of removed features (amp, elasticity, "
    "sparse_attention, ...), rather than train without them.",
)
def _removed_keys(ctx: Context) -> Iterator[Finding]:
    for key, why in K.REMOVED_TOP_LEVEL_KEYS.items():
        if key in ctx.cfg:
            yield _f("ZP502", key, f"{key}: {why}", f"remove the {key!r} block")
    for key, why in K.REMOVED_ZERO_KEYS.items():
        if key in ctx.zero:
            yield _f("ZP502", f"zero_optimization.{key}", f"{key}: {why}", f"remove zero_optimization.{key}")


@rule(
    "ZP503", "error", "Duplicate key",
    "JSON readers keep the last of two equal keys, so one setting silently loses; DeepSpeed's own loader "
    "rejects the file.",
)
def _duplicates(ctx: Context) -> Iterator[Finding]:
    for path in ctx.duplicate_keys:
        yield _f("ZP503", path, f"{path} appears more than once (only the last value counts)", "keep one of them")


@rule(
    "ZP506", "warning", "Comments or trailing commas",
    "DeepSpeed reads config files with hjson and accepts them, but the Hugging Face Trainer / accelerate read the "
    "same file with json.load and fail.",
)
def _hjson_syntax(ctx: Context) -> Iterator[Finding]:
    if ctx.syntax == "hjson":
        yield _f("ZP506", "", "the file has comments or trailing commas (hjson): DeepSpeed accepts it, JSON readers do not",
                 "remove comments and trailing commas to make it plain JSON")


#: What Hugging Face's Trainer writes for "auto" (transformers/integrations/deepspeed.py
#: ``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize``).
_HF_AUTO = {
    "train_micro_batch_size_per_gpu": "TrainingArguments.per_device_train_batch_size",
    "gradient_accumulation_steps": "TrainingArguments.gradient_accumulation_steps",
    "train_batch_size": "world size × per_device_train_batch_size × gradient_accumulation_steps",
    "gradient_clipping": "TrainingArguments.max_grad_norm (default 1.0)",
    "optimizer.params.lr": "TrainingArguments.learning_rate (default 5e-5)",
    "optimizer.params.betas": "[adam_beta1, adam_beta2] (default [0.9, 0.999])",
    "optimizer.params.eps": "TrainingArguments.adam_epsilon (default 1e-8)",
    "optimizer.params.weight_decay": "TrainingArguments.weight_decay (default 0.0)",
    "scheduler.params.warmup_min_lr": "0",
    "scheduler.params.warmup_max_lr": "TrainingArguments.learning_rate",
    "scheduler.params.warmup_num_steps": "TrainingArguments warmup steps",
    "scheduler.params.total_num_steps": "the number of training steps",
    "fp16.enabled": "TrainingArguments.fp16",
    "bf16.enabled": "TrainingArguments.bf16",
}
#: "auto" here reaches DeepSpeed as a string outside the HF Trainer and crashes it.
_AUTO_CRASHES = {"train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping"}


def _auto_resolution(ctx: Context, path: str) -> str:
    h = ctx.model.hidden_size if ctx.model is not None else None
    if path == "train_batch_size":
        mb, ga = ctx.cfg.get("train_micro_batch_size_per_gpu"), ctx.cfg.get("gradient_accumulation_steps")
        if ctx.world_size and _is_int_value(mb) and _is_int_value(ga):
            return f"{int(mb) * int(ga) * ctx.world_size} ({int(mb)} × {int(ga)} × {ctx.world_size} GPUs)"
    hidden_rules = {
        "zero_optimization.reduce_bucket_size": ("hidden_size²", lambda h: h * h),
        "zero_optimization.stage3_prefetch_bucket_size": ("int(0.9 · hidden_size²)", lambda h: int(0.9 * h * h)),
        "zero_optimization.stage3_param_persistence_threshold": ("10 · hidden_size", lambda h: 10 * h),
    }
    if path in hidden_rules:
        text, fn = hidden_rules[path]
        return f"{_fmt(fn(h))} ({text}, hidden_size {h})" if h else f"{text} of the model (give --model to compute it)"
    if path in _HF_AUTO:
        return _HF_AUTO[path]
    return "a value the Hugging Face Trainer fills in; plain DeepSpeed drops it and uses its default"


@rule(
    "ZP504", "info", "\"auto\" values",
    "\"auto\" is filled in only by the Hugging Face Trainer integration; plain deepspeed.initialize crashes on "
    "\"auto\" batch keys and silently uses defaults elsewhere.",
)
def _auto_values(ctx: Context) -> Iterator[Finding]:
    for path, value in _walk(ctx.cfg):
        if value != "auto":
            continue
        resolved = _auto_resolution(ctx, path)
        if path in _AUTO_CRASHES:
            yield _f("ZP504", path, f"{path} is \"auto\" → {resolved}; outside the HF Trainer DeepSpeed fails on it",
                     "replace \"auto\" with a number unless the config is only used through transformers' Trainer",
                     severity="warning")
        else:
            yield _f("ZP504", path, f"{path} is \"auto\" → {resolved}", "nothing to do with the HF Trainer; write the value for plain DeepSpeed")


@rule(
    "ZP505", "error", "Block that is not an object",
    "DeepSpeed builds its config models with **block; \"fp16\": true or a list fails with a TypeError.",
)
def _block_types(ctx: Context) -> Iterator[Finding]:
    for name in ("fp16", "bf16", "optimizer", "scheduler", "activation_checkpointing"):
        if name in ctx.cfg and not isinstance(ctx.cfg[name], dict):
            yield _f("ZP505", name, f"{name} is {ctx.cfg[name]!r}, not an object",
                     f"write it as an object, e.g. \"{name}\": {{\"enabled\": true}}" if name in ("fp16", "bf16")
                     else f"write {name} as a JSON object {{...}}")
    z = ctx.cfg.get("zero_optimization")
    if z is not None and not isinstance(z, (dict, bool)):
        yield _f("ZP505", "zero_optimization", f"zero_optimization is {z!r}, not an object",
                 "write it as {\"stage\": 2, ...}")
    for name in ("offload_param", "offload_optimizer"):
        block = ctx.zero.get(name)
        if block is not None and not isinstance(block, dict):
            yield _f("ZP505", f"zero_optimization.{name}", f"{name} is {block!r}, not an object",
                     f"write it as \"{name}\": {{\"device\": \"cpu\", \"pin_memory\": true}}")
