"""The post-training recipe of a Trainer script, read from its trainer and its config.

A probe or a discovery run finds the ``transformers.Trainer`` (TRL's trainers subclass it) that
builds the engine (:mod:`zeroplan.runtime.rank.recipe_watch`) and hands its class names and its
``args`` here. The answer is a plain dict with the keys of ``zeroplan.spec.recipe.Recipe``
(:data:`RECIPE_KEYS`), so the estimator reads it as it reads ``--recipe`` and its flags, and the
TRL config values that go with it (:func:`trl_values`, TRL's field names), which ``tune``
exports beside the DeepSpeed config. No torch import.

What TRL 1.16 does with each value (trl/trainer/dpo_trainer.py, grpo_trainer.py):

* DPOTrainer: a reference model unless the policy is a PEFT model (the adapter is disabled
  instead) or ``precompute_ref_log_probs`` is set (dpo_trainer.py:908-914);
* GRPOTrainer: a reference model only when ``beta != 0`` and the policy is not a PEFT model
  (grpo_trainer.py:983-991; ``beta`` defaults to 0.0); ``num_generations`` completions of at
  most ``max_completion_length`` tokens per prompt; a colocated vLLM engine when ``use_vllm``
  and ``vllm_mode == "colocate"``, taking ``vllm_gpu_memory_utilization`` of the GPU;
* both: the reference is prepared by ``trl.models.utils.prepare_deepspeed`` — the policy's
  config, stage 3 kept, any other stage set to 0, ``offload_param`` kept (so a ZeRO-3 policy
  with parameter offload has an offloaded reference).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

__all__ = ["RECIPE_KEYS", "TRAINER_RECIPES", "TRL_KEYS", "recipe_from_trainer", "trl_values"]

#: The keys of the recipe dict (``zeroplan.spec.recipe.Recipe.from_dict`` reads them).
RECIPE_KEYS = ("kind", "generations", "completion_len", "vllm_gpu_memory", "reference", "reward_model", "critic_model")

#: Trainer classes whose recipe zeroplan reads, by class name (the first match in the MRO wins).
TRAINER_RECIPES = {"DPOTrainer": "dpo", "GRPOTrainer": "grpo", "SFTTrainer": "sft", "Trainer": "sft"}

#: TrainingArguments-style keys exported per recipe (TRL's field names), besides the batch keys.
TRL_KEYS = {
    "sft": ("max_length", "gradient_checkpointing", "bf16", "fp16"),
    "dpo": ("max_length", "beta", "precompute_ref_log_probs", "gradient_checkpointing", "bf16", "fp16"),
    # generation_batch_size is left out: GRPOConfig derives it from steps_per_generation and refuses
    # both set at once (trl/trainer/grpo_config.py __post_init__).
    "grpo": ("num_generations", "max_completion_length", "beta", "steps_per_generation", "num_iterations", "use_vllm",
             "vllm_mode", "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "ds3_gather_for_generation",
             "gradient_checkpointing", "bf16", "fp16"),
}
_BATCH_KEYS = ("per_device_train_batch_size", "gradient_accumulation_steps")


def _get(args: Any, name: str, default: Any = None) -> Any:
    return args.get(name, default) if isinstance(args, dict) else getattr(args, name, default)


def recipe_kind(class_names: Iterable[str]) -> Optional[str]:
    """The recipe of a trainer from its class and base-class names (MRO order), else None."""
    for name in class_names:
        if name in TRAINER_RECIPES:
            return TRAINER_RECIPES[name]
    return None


def recipe_from_trainer(
    class_names: Iterable[str], args: Any, *, peft: bool = False, reference_offload: bool = False
) -> Optional[dict]:
    """The recipe dict (:data:`RECIPE_KEYS`) of a trainer whose class/base names are
    ``class_names`` and whose config is ``args`` (a TrainingArguments object or its dict);
    None for a trainer that is none of :data:`TRAINER_RECIPES`.

    ``peft``: the policy is a PEFT model (TRL then disables the adapter for the reference
    log-probs and loads no reference model: ``reference`` is ``none``, no weights held).
    ``reference_offload``: the reference's parameters live on the host (the policy's ZeRO-3
    ``offload_param``, which ``prepare_deepspeed`` keeps).
    """
    kind = recipe_kind(class_names)
    if kind is None:
        return None
    recipe = dict.fromkeys(RECIPE_KEYS)
    recipe["kind"] = kind
    if kind == "sft":
        return recipe
    reference = "offload" if reference_offload else "model"
    if kind == "dpo":
        if peft:
            reference = "none"
        elif _get(args, "precompute_ref_log_probs", False):
            reference = "precomputed"
    else:
        recipe["generations"] = int(_get(args, "num_generations") or 8)
        recipe["completion_len"] = int(_get(args, "max_completion_length") or 512)
        if _get(args, "use_vllm", False) and _get(args, "vllm_mode", "colocate") == "colocate":
            recipe["vllm_gpu_memory"] = float(_get(args, "vllm_gpu_memory_utilization", 0.3))
        if peft or float(_get(args, "beta", 0.0) or 0.0) == 0.0:
            reference = "none"
    recipe["reference"] = reference
    return recipe


def trl_values(kind: str, args: Any) -> dict:
    """The TrainingArguments-style values of ``args`` that shape a ``kind`` run's memory and batch
    (:data:`TRL_KEYS` plus the batch keys), by TRL's field names; keys ``args`` lacks are left out, and
    vLLM's settings without ``use_vllm``. ``DPOConfig``/``GRPOConfig(output_dir, **values)`` accepts them."""
    out: dict = {}
    for key in _BATCH_KEYS + TRL_KEYS.get(kind, ()):
        if key.startswith("vllm_") and not _get(args, "use_vllm", False):
            continue  # no vLLM engine: its settings do not apply
        value = _get(args, key)
        if value is None and key not in ("beta",):
            continue
        if isinstance(value, (bool, int, float, str)) or value is None:
            out[key] = value
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def recipe_lines(trainer: Optional[str], recipe: Optional[dict], frozen: Iterable[dict] = (), phases: Optional[dict] = None) -> list[str]:
    """What a probe or discovery says about a Trainer's recipe: one line for the recipe and its
    frozen engines, one for rank 0's memory phases (entry → peak live bytes)."""
    if not recipe:
        return []
    words = [f"recipe: {recipe['kind']} ({trainer or 'trainer'})"]
    if recipe.get("generations"):
        words.append(f"{recipe['generations']} generations of up to {recipe['completion_len']} tokens per prompt")
    if recipe.get("vllm_gpu_memory") is not None:
        words.append(f"colocated vLLM at {recipe['vllm_gpu_memory']:g} of the GPU")
    if recipe["kind"] != "sft":
        words.append(f"reference: {recipe.get('reference')}")
    for engine in frozen:
        where = f", parameters offloaded to {engine['offload_param']}" if engine.get("offload_param") else ""
        words.append(f"frozen engine {engine['class']} ({engine['params']:,} params) at ZeRO stage {engine['stage']}{where}")
    lines = ["; ".join(words)]
    if phases:
        order = ("generation", "scoring", "rollout", "loss_forward", "backward")
        parts = [f"{name.replace('_', ' ')} {_mib(p['entry_bytes'])} → {_mib(p['peak_bytes'])}"
                 for name in order for p in [phases.get(name)] if p]
        lines.append("memory phases, rank 0 (live at entry → peak inside): " + "; ".join(parts))
    return lines
