"""PPO's critic and reward models as ModelSpecs (``--critic-model``, ``--reward-model``)."""

from __future__ import annotations

from typing import Optional

from zeroplan.profiles.resolve import resolve_model
from zeroplan.spec import ModelSpec
from zeroplan.spec.recipe import Recipe

__all__ = ["recipe_models"]


def recipe_models(recipe: Optional[Recipe]) -> dict[str, Optional[ModelSpec]]:
    """``{"critic": ..., "reward": ...}`` for :func:`~zeroplan.estimator.plans_recipe.estimate_recipe_plan`:
    each a preset or config.json resolved as ``--model`` is, None when not given (the policy's shape)."""
    if recipe is None:
        return {}
    return {
        "critic": resolve_model(None, recipe.critic_model) if recipe.critic_model else None,
        "reward": resolve_model(None, recipe.reward_model) if recipe.reward_model else None,
    }
