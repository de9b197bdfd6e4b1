"""The TRL config values that go with an exported DeepSpeed config (``zeroplan export --recipe``).

A DPO or GRPO run is configured twice: the DeepSpeed JSON (``export``'s main output) and the
trainer's ``DPOConfig`` / ``GRPOConfig``, whose batch keys must agree with it and whose recipe
keys decide the memory the estimate assumed. :func:`trl_config_values` gives the second, keyed
by TRL's field names (trl 1.16: trl/trainer/dpo_config.py, grpo_config.py), so a script can do
``GRPOConfig(**json.load(open("ds_config.trl.json")))``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from zeroplan.spec import Plan, TrainingSpec
from zeroplan.spec.recipe import Recipe

__all__ = ["GRPO_KL_BETA", "trl_config_values", "trl_sidecar_path"]

#: GRPO's KL coefficient when a reference model is wanted: DeepSeekMath's 0.04 (arXiv 2402.03300,
#: §4.2), TRL's default before 0.23; TRL's own default is 0.0 (no reference model, ``--reference none``).
GRPO_KL_BETA = 0.04


def trl_config_values(recipe: Recipe, plan: Plan, training: TrainingSpec, *, deepspeed_path: Optional[str] = None) -> dict:
    """``DPOConfig`` / ``GRPOConfig`` / ``SFTConfig`` keyword arguments for ``plan`` under ``recipe``.

    Batch keys match the DeepSpeed config (``per_device_train_batch_size`` = its micro-batch,
    ``gradient_accumulation_steps``); ``bf16``/``fp16`` and ``gradient_checkpointing`` match the
    plan; the recipe keys are the ones the estimate assumed: ``max_length`` (DPO, SFT: the
    sequence), ``max_completion_length`` and ``num_generations`` (GRPO), ``beta`` (DPO's default
    0.1; GRPO 0.0 without a reference, :data:`GRPO_KL_BETA` with one),
    ``precompute_ref_log_probs`` (DPO), and for a colocated vLLM engine ``use_vllm``,
    ``vllm_mode="colocate"``, ``vllm_gpu_memory_utilization`` and ``vllm_enable_sleep_mode``.
    ``steps_per_generation`` is left to TRL's default (``gradient_accumulation_steps``), which
    the estimate's generation batch assumes. PPO has no trainer in trl 1.16: its values are
    the batch keys only.
    """
    values: dict = {
        "per_device_train_batch_size": plan.micro_batch,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "gradient_checkpointing": plan.checkpointing != "none",
    }
    if training.precision in ("bf16", "bf16-pure"):
        values["bf16"] = True
    elif training.precision == "fp16":
        values["fp16"] = True
    if deepspeed_path is not None:
        values["deepspeed"] = deepspeed_path
    if recipe.kind in ("sft", "dpo"):
        values["max_length"] = training.seq_len
    if recipe.kind == "dpo":
        values["beta"] = 0.1
        values["precompute_ref_log_probs"] = recipe.reference == "precomputed"
    if recipe.kind == "grpo":
        values["num_generations"] = recipe.generations
        values["max_completion_length"] = recipe.completion_len
        values["beta"] = GRPO_KL_BETA if recipe.reference in ("model", "offload") else 0.0
        if recipe.vllm_gpu_memory is not None:
            values.update(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=recipe.vllm_gpu_memory,
                          vllm_enable_sleep_mode=recipe.vllm_sleep)
    return values


def trl_sidecar_path(output: str) -> Path:
    """Where the TRL values go beside ``output``: ``ds_config.json`` → ``ds_config.trl.json``."""
    path = Path(output)
    return path.with_name(path.stem + ".trl.json")
