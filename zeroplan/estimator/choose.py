"""Choosing a plan: the fastest one the estimator predicts fits (what ``zeroplan export`` writes
when no plan is given, and what a Python user gets from one call)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from zeroplan.estimator.plans import PlanEstimate, enumerate_plans, estimate_all
from zeroplan.spec import ClusterSpec, ModelSpec, Plan, TrainingSpec

__all__ = ["PlanChoice", "best_plan"]


@dataclass(frozen=True)
class PlanChoice:
    """The best plan among those considered, and how many fit."""

    best: Optional[PlanEstimate]
    """The fastest plan that fits (highest predicted tokens/s), or None when none fits."""
    fitting: int
    """Plans that fit."""
    considered: int
    """Plans estimated (every valid stage × offload × checkpointing × micro-batch within the filters)."""


def best_plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    *,
    stage: Optional[int] = None,
    offload_optimizer: Optional[str] = None,
    offload_param: Optional[str] = None,
    checkpointing: Optional[str] = None,
    device: str = "cuda",
    activation_bytes: Optional[Callable[[Plan], int]] = None,
    engine: str = "deepspeed",
    optimizer_impl: Optional[str] = None,
    buckets: Optional[dict] = None,
    sp=(1,),
    tp=(1,),
    tiled_mlp: bool = False,
    expert_degrees=None,
    recipe=None,
    recipe_models: Optional[dict] = None,
    model_save: Optional[str] = None,
    model_build: Optional[str] = None,
) -> PlanChoice:
    """The fastest plan that fits, within the given filters (None: any value).

    Enumerates plans with :func:`~zeroplan.estimator.enumerate_plans`, estimates and ranks them
    with :func:`~zeroplan.estimator.estimate_all` (fitting plans first, fastest first) and takes
    the first that fits. ``optimizer_impl`` and ``buckets`` (plan bucket fields, e.g. from
    ``bucket_sizes``) are passed to both; ``sp``, ``tp`` (degrees or ``"auto"``) and ``tiled_mlp``
    to the plan space; ``expert_degrees`` (``--ep``: a list or ``"auto"``)
    adds the expert-parallel degrees (:func:`~zeroplan.estimator.expert_parallel.with_expert_degrees`). ``recipe`` (a :class:`~zeroplan.spec.recipe.Recipe`)
    estimates each plan under it (:func:`~zeroplan.estimator.plans_recipe.estimate_recipe_all`,
    ``recipe_models``: PPO's critic and reward) and keeps only plans whose batch TRL accepts
    (:func:`~zeroplan.estimator.plans_recipe.trl_accepts`). ``model_save`` says how the run saves
    checkpoints, for the host's save phase (:mod:`zeroplan.estimator.host_save`; None: the device's default),
    ``model_build`` how each rank builds or loads the model, for the host's model-build phase
    (:data:`~zeroplan.estimator.host.BUILDS`; None: the engine's default at each plan,
    :func:`~zeroplan.estimator.host.default_build`; ``zero_init`` narrows an open stage to 3,
    :func:`~zeroplan.estimator.host.stage_for_build`).
    """
    from zeroplan.estimator.host import stage_for_build

    plans = enumerate_plans(
        model, cluster, training,
        stage=stage_for_build(stage, model_build), offload_optimizer=offload_optimizer, offload_param=offload_param, checkpointing=checkpointing, engine=engine,
        optimizer_impl=optimizer_impl, buckets=buckets, sp=sp, tp=tp, tiled_mlp=tiled_mlp,
    )
    if expert_degrees is not None:
        from zeroplan.estimator.expert_parallel import with_expert_degrees

        plans = with_expert_degrees(plans, model, cluster.gpus, expert_degrees)
    if recipe is not None:
        from zeroplan.estimator.plans_recipe import estimate_recipe_all, trl_accepts

        plans = [p for p in plans if trl_accepts(p, cluster.gpus, recipe)]
        ranked = estimate_recipe_all(model, cluster, training, plans, recipe, device=device, activation_bytes=activation_bytes,
                                     engine=engine, optimizer_impl=optimizer_impl, model_save=model_save, model_build=model_build,
                                     **(recipe_models or {}))
    else:
        ranked = estimate_all(model, cluster, training, plans, device=device, activation_bytes=activation_bytes, engine=engine,
                              optimizer_impl=optimizer_impl, model_save=model_save, model_build=model_build)
    fitting = [e for e in ranked if e.fits]
    return PlanChoice(best=fitting[0] if fitting else None, fitting=len(fitting), considered=len(ranked))
