"""A probe's estimate for a Trainer script: the plan and training as the trainer ran them, and the
recipe the run trained (DPO, GRPO) when the estimator models recipes.

The DeepSpeed config does not say everything a Trainer does: ``gradient_checkpointing`` and
``bf16``/``fp16`` are TrainingArguments (TRL's configs default both to True: trl/trainer/
dpo_config.py, grpo_config.py, sft_config.py), and ``"auto"`` in the config resolves to them
(transformers/integrations/deepspeed.py ``trainer_config_process``). The rank reports the
trainer's values (``trl`` in its result, :mod:`zeroplan.runtime.rank.recipe_watch`); they override
what the config alone would give.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["apply_trainer_values", "estimate_for_recipe", "plan_as_trained", "training_as_trained"]


def plan_as_trained(trl: Optional[dict], plan: Any) -> Any:
    """``plan`` as the trainer ran it: ``checkpointing="full"`` when the trainer checkpointed every
    block (``gradient_checkpointing=True``, a TrainingArguments value the DeepSpeed config does not
    carry: transformers' ``gradient_checkpointing_enable`` wraps each decoder layer); unchanged
    without trainer values, without a plan, or with a checkpointing the config already gives."""
    if plan is None or not trl or not trl.get("gradient_checkpointing") or plan.checkpointing != "none":
        return plan
    return dataclasses.replace(plan, checkpointing="full")


def apply_trainer_values(trl: Optional[dict], plan: Any, training: Any, *, fused_lm_head: bool = False) -> tuple[Any, Any]:
    """``plan`` with ``checkpointing="full"`` when the trainer checkpointed every block
    (``gradient_checkpointing=True``: transformers' per-layer checkpoint) and ``training`` with the
    trainer's ``bf16``/``fp16``; unchanged without trainer values. ``fused_lm_head``: the run's
    model had TRL's fused log-prob head (:func:`zeroplan.runtime.rank.recipe_watch.fused_lm_head`), so
    the default loss ``hf`` becomes ``trl`` where the estimator knows that loss."""
    return plan_as_trained(trl, plan), training_as_trained(trl, training, fused_lm_head=fused_lm_head)


def training_as_trained(trl: Optional[dict], training: Any, *, fused_lm_head: bool = False) -> Any:
    """``training`` with the trainer's ``bf16``/``fp16`` (TrainingArguments; TRL's configs default
    ``bf16=True``) and, with TRL's fused log-prob head on the model, the loss ``trl`` in place of
    the default ``hf``; unchanged without trainer values."""
    from zeroplan.spec.training import LOSSES

    if fused_lm_head and training.loss == "hf" and "trl" in LOSSES:
        training = dataclasses.replace(training, loss="trl")
    if not trl:
        return training
    if trl.get("bf16") and training.precision not in ("bf16", "bf16-pure"):
        training = dataclasses.replace(training, precision="bf16")
    elif trl.get("fp16") and training.precision != "fp16":
        training = dataclasses.replace(training, precision="fp16")
    return training


def estimate_for_recipe(recipe: Optional[dict], model, cluster, training, plan, **kwargs) -> tuple[Any, Optional[str]]:
    """(PlanEstimate, note): the recipe's estimate (``zeroplan.estimator.plans_recipe``) for a
    recipe other than ``sft``; where this zeroplan has no recipe estimator, the supervised
    estimate and a note saying so."""
    from zeroplan import estimator

    if not recipe or recipe.get("kind") in (None, "sft"):
        return estimator.estimate_plan(model, cluster, training, plan, **kwargs), None
    try:
        from zeroplan.estimator.plans_recipe import estimate_recipe_plan
        from zeroplan.spec.recipe import Recipe
    except ImportError:
        note = (f"recipe {recipe['kind']} not estimated by this zeroplan: the estimate is supervised fine-tuning's "
                "(no reference model, no paired sequences, no generation)")
        return estimator.estimate_plan(model, cluster, training, plan, **kwargs), note
    return estimate_recipe_plan(model, cluster, training, plan, Recipe.from_dict(recipe), **kwargs), None
