"""The estimate use case: a frozen :class:`EstimateRequest` in, every plan estimated and ranked out.

``zeroplan estimate`` resolves its option groups into the request (model, cluster and training
specs, the plan filters, the engine's choices, a recipe with its extra models, a traced activation
override) and renders the :class:`EstimateOutcome`; a benchmark or a notebook calls
:func:`run_estimate` the same way. Stdlib only, like the rest of the estimator.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from zeroplan.spec import CHECKPOINTING_ALIASES, ClusterSpec, ModelSpec, SpecError, TrainingSpec

__all__ = ["EstimateOutcome", "EstimateRequest", "check_model_build", "resolve_checkpointing", "run_estimate", "with_training_choices"]


def check_model_build(model_build: Optional[str], *, engine: str, stage: Optional[int], stage_from: str = "--stage") -> None:
    """``--model-build``: one of :data:`~zeroplan.estimator.host.BUILDS`; ``zero_init`` is DeepSpeed's
    ``zero.Init``, which partitions at construction and exists for stage 3 only (``stage`` None: not
    fixed yet, :func:`~zeroplan.estimator.host.stage_for_build` narrows the space to 3).
    ``stage_from`` names where the stage comes from, for the message (a config's key under validate)."""
    from zeroplan.estimator.host import BUILDS

    if model_build is not None and model_build not in BUILDS:
        raise SpecError(f"--model-build {model_build!r} is not valid; choose one of {', '.join(BUILDS)}")
    if model_build == "zero_init" and (engine != "deepspeed" or stage in (0, 1, 2)):
        if stage_from == "--stage" or engine != "deepspeed":
            raise SpecError("--model-build zero_init is DeepSpeed's zero.Init, stage 3 only; give --stage 3 or fp32 | bf16 | meta | rank0")
        raise SpecError(f"--model-build zero_init is DeepSpeed's zero.Init, stage 3 only, and {stage_from} is {stage}; "
                        "give fp32 | bf16 | meta | rank0")


def resolve_checkpointing(model: ModelSpec, training: TrainingSpec, checkpointing: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(the checkpointing name, a note): an old name becomes today's (``selective`` → ``attention``),
    and an option that keeps exactly what another keeps says so
    (:func:`~zeroplan.estimator.activations.checkpointing_duplicate`)."""
    note = None
    if checkpointing in CHECKPOINTING_ALIASES:
        note = f"--checkpointing {checkpointing} is now called {CHECKPOINTING_ALIASES[checkpointing]} (Korthikanti's attention-core recomputation)"
        checkpointing = CHECKPOINTING_ALIASES[checkpointing]
    if checkpointing is not None:
        from zeroplan.estimator.activations import checkpointing_duplicate

        note = "; ".join(n for n in (note, checkpointing_duplicate(model, training, checkpointing)) if n) or None
    return checkpointing, note


@dataclass(frozen=True)
class EstimateRequest:
    """What to estimate: specs already resolved, the plan filters and the engine's choices."""

    model: ModelSpec
    cluster: ClusterSpec
    training: TrainingSpec
    #: Plan filters (None: every value the space allows); ``checkpointing`` as :func:`resolve_checkpointing` returns it.
    stage: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_param: Optional[str] = None
    checkpointing: Optional[str] = None
    #: ``--sp``/``--tp`` degrees (None: not asked; the space may widen to sp > 1 when nothing fits).
    sp: Optional[tuple] = None
    tp: Optional[tuple] = None
    tiled_mlp: bool = False
    #: ``--ep`` as given (parsed by :func:`~zeroplan.estimator.expert_parallel.parse_expert_degrees`).
    ep: Optional[str] = None
    #: ``--cp`` degrees (None: not asked; under --engine fsdp the space may widen to cp > 1 when nothing fits).
    cp: Any = None
    engine: str = "deepspeed"
    optimizer_impl: Optional[str] = None
    #: The plan's bucket fields (and ``overlap_comm``), from the engine options.
    buckets: dict = field(default_factory=dict, hash=False)
    expandable_segments: bool = False
    model_build: Optional[str] = None
    #: ``--model-save``: how checkpoints are saved (:data:`~zeroplan.estimator.host_save.MODEL_SAVES`; None: the Trainer on GPUs).
    model_save: Optional[str] = None
    #: A traced activation override (``zeroplan.trace``), or None for the formula.
    activation_bytes: Any = None
    #: A post-training recipe and its extra models (``zeroplan.profiles.recipe_models``).
    recipe: Any = None
    recipe_models: dict = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class EstimateOutcome:
    """Every plan estimated, best first (:func:`~zeroplan.estimator.estimate_all`'s order)."""

    estimates: list
    #: Why the space widened to sequence parallelism (or that it did not help), else None.
    layout_note: Optional[str] = None


def run_estimate(request: EstimateRequest) -> EstimateOutcome:
    """Enumerate the plans the request allows, estimate each (under its recipe when one is given)
    and rank them (:func:`~zeroplan.estimator.layout_space.estimate_with_layouts`)."""
    from zeroplan.estimator.expert_parallel import parse_expert_degrees, with_expert_degrees
    from zeroplan.estimator.host import stage_for_build
    from zeroplan.estimator.layout_space import estimate_with_layouts

    r = request
    recipe = r.recipe
    if recipe is not None:  # the recipe terms' modules only for a recipe (plain SFT does not import them)
        from zeroplan.estimator.plans_recipe import estimate_recipe_all
    estimates, layout_note = estimate_with_layouts(
        r.model, r.cluster, r.training, sp=r.sp, tp=r.tp, cp=r.cp,
        plan_options=dict(stage=stage_for_build(r.stage, r.model_build), offload_optimizer=r.offload_optimizer,
                          offload_param=r.offload_param, checkpointing=r.checkpointing, engine=r.engine,
                          optimizer_impl=r.optimizer_impl, buckets=r.buckets, tiled_mlp=r.tiled_mlp),
        estimate_options=dict(activation_bytes=r.activation_bytes, engine=r.engine, optimizer_impl=r.optimizer_impl,
                              expandable_segments=r.expandable_segments, model_build=r.model_build,
                              model_save=r.model_save),
        estimate_many=None if recipe is None else (
            lambda m, c, t, plans, **kw: estimate_recipe_all(m, c, t, plans, recipe, **kw, **r.recipe_models)),
        expand=lambda plans: with_expert_degrees(plans, r.model, r.cluster.gpus, parse_expert_degrees(r.ep, engine=r.engine)),
    )
    return EstimateOutcome(estimates=estimates, layout_note=layout_note)


def with_training_choices(training: TrainingSpec, *, flash_attention: bool, loss: Optional[str]) -> TrainingSpec:
    """The training spec with ``--no-flash`` and ``--loss`` applied (``hf`` when not given)."""
    if not flash_attention:
        training = replace(training, flash_attention=False)
    return replace(training, loss=loss or "hf")
