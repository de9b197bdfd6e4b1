"""Hugging Face Trainer scripts (and TRL's trainers, which subclass it): how zeroplan talks to them.

A Trainer script takes its DeepSpeed config as ``--deepspeed PATH`` (HfArgumentParser rejects
``--deepspeed_config``) and has batch flags of its own. transformers checks every explicit
batch value of the config against TrainingArguments and refuses a mismatch
(integrations/deepspeed.py ``HfTrainerDeepSpeedConfig.trainer_config_process`` → "Please correct
the following DeepSpeed config values that mismatch TrainingArguments values"), so zeroplan passes
each plan's micro-batch and accumulation as the Trainer flags too — the ``arg_mappings`` that
DeepSpeed's autotuner makes users write by hand.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from zeroplan.spec import Plan

__all__ = [
    "TRAINER_CONFIG_ARG",
    "is_trainer_script",
    "trainer_batch_args",
    "trainer_precision",
    "batch_is_auto",
]

#: How Trainer scripts take a DeepSpeed config (TrainingArguments.deepspeed).
TRAINER_CONFIG_ARG = "--deepspeed"

_TRAINER_RE = re.compile(
    r"\b(TrainingArguments|Seq2SeqTrainingArguments|HfArgumentParser|SFTConfig|SFTTrainer|DPOConfig|DPOTrainer|"
    r"GRPOConfig|GRPOTrainer|RewardTrainer|Trainer\s*\()"
)


def is_trainer_script(script: Path) -> bool:
    """True when the script builds TrainingArguments or a Trainer (transformers or TRL)."""
    return bool(_TRAINER_RE.search(Path(script).read_text(errors="replace")))


def trainer_batch_args(plan: Plan) -> tuple[str, ...]:
    """The TrainingArguments flags that make Trainer run ``plan``'s batch shape."""
    return (
        "--per_device_train_batch_size",
        str(plan.micro_batch),
        "--gradient_accumulation_steps",
        str(plan.gradient_accumulation_steps),
    )


def batch_is_auto(config: Optional[dict]) -> bool:
    """True when the config leaves the batch shape to Trainer (``"auto"`` micro-batch or accumulation)."""
    if not config:
        return False
    return "auto" in (config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps"))


def _flag_on(args: tuple[str, ...], flag: str) -> bool:
    for i, arg in enumerate(args):
        if arg == flag:
            nxt = args[i + 1].lower() if i + 1 < len(args) else ""
            return nxt not in ("false", "0", "no")
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1].lower() in ("true", "1", "yes")
    return False


def trainer_precision(script_args: tuple[str, ...], config: Optional[dict]) -> str:
    """The precision Trainer trains in: an explicit ``bf16``/``fp16`` block of the config, else
    the script's ``--bf16``/``--fp16`` flag (what ``"auto"`` resolves to), else fp32."""
    for name in ("bf16", "fp16"):
        enabled = ((config or {}).get(name) or {}).get("enabled") if isinstance((config or {}).get(name), dict) else None
        if enabled is True:
            return name
    for name in ("bf16", "fp16"):
        if _flag_on(script_args, f"--{name}"):
            return name
    return "fp32"
