"""The recipe options (``--recipe``, ``--generations``, ...) every planning command shares, and
their conversion to a :class:`~zeroplan.spec.recipe.Recipe` (docs/recipes.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from zeroplan.spec.recipe import Recipe

__all__ = [
    "CompletionLenOpt",
    "CriticModelOpt",
    "GenerationsOpt",
    "RecipeOpt",
    "ReferenceOpt",
    "RewardModelOpt",
    "VllmGpuMemoryOpt",
    "VllmSleepOpt",
    "resolve_recipe",
]

_RECIPE = "Recipe"

RecipeOpt = Annotated[Optional[str], typer.Option(
    "--recipe", help="sft | dpo | grpo | ppo: what the run does around the policy's training pass (docs/recipes.md) [default: sft].",
    rich_help_panel=_RECIPE)]
GenerationsOpt = Annotated[Optional[int], typer.Option(
    "--generations", help="GRPO/PPO: completions per prompt, G (num_generations) [default: 8 for grpo, 1 for ppo].",
    rich_help_panel=_RECIPE)]
CompletionLenOpt = Annotated[Optional[int], typer.Option(
    "--completion-len", help="GRPO/PPO: tokens per completion (max_completion_length), part of --seq-len [default: 512].",
    rich_help_panel=_RECIPE)]
VllmGpuMemoryOpt = Annotated[Optional[float], typer.Option(
    "--vllm-gpu-memory", help="GRPO/PPO: a colocated vLLM engine's gpu_memory_utilization, e.g. 0.3 (absent: generation with the policy).",
    rich_help_panel=_RECIPE)]
VllmSleepOpt = Annotated[bool, typer.Option(
    "--vllm-sleep", help="The colocated vLLM engine sleeps while the policy trains (vllm_enable_sleep_mode=True).",
    rich_help_panel=_RECIPE)]
ReferenceOpt = Annotated[Optional[str], typer.Option(
    "--reference", help="model | offload | precomputed | none: the frozen reference model [default: model for dpo/ppo, none for grpo (beta=0)].",
    rich_help_panel=_RECIPE)]
RewardModelOpt = Annotated[Optional[str], typer.Option(
    "--reward-model", help="PPO: the reward model, a preset or config.json [default: the policy's shape].", rich_help_panel=_RECIPE)]
CriticModelOpt = Annotated[Optional[str], typer.Option(
    "--critic-model", help="PPO: the critic (value) model, a preset or config.json [default: the policy's shape].", rich_help_panel=_RECIPE)]


def resolve_recipe(
    recipe: Optional[str], *, generations: Optional[int] = None, completion_len: Optional[int] = None,
    vllm_gpu_memory: Optional[float] = None, vllm_sleep: bool = False, reference: Optional[str] = None,
    reward_model: Optional[str] = None, critic_model: Optional[str] = None,
) -> Optional[Recipe]:
    """The Recipe the options describe; None when no recipe option is given (plain SFT, every
    output as before). Bad combinations raise SpecError naming the option."""
    given = (generations, completion_len, vllm_gpu_memory, reference, reward_model, critic_model)
    if recipe is None and all(v is None for v in given) and not vllm_sleep:
        return None
    from zeroplan.spec.recipe import Recipe

    return Recipe(
        kind=recipe or "sft", generations=generations, completion_len=completion_len, vllm_gpu_memory=vllm_gpu_memory,
        reference=reference, reward_model=reward_model, critic_model=critic_model, vllm_sleep=vllm_sleep,
    )
