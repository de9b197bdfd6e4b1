"""The export use case: a frozen :class:`ExportRequest` in, the config of one plan out.

The plan is the one the request names (``stage`` and ``micro_batch`` given: taken as given, the
estimator only saying whether it fits) or the fastest one the estimator says fits within the
request's filters. ``zeroplan export`` resolves its option groups into the request and writes what
:func:`run_export` returns; the library writes no file.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from zeroplan.spec import RUNNABLE_ENGINES, ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec, engine_facts

__all__ = ["ExportOutcome", "ExportRequest", "choose_export_plan", "run_export"]


@dataclass(frozen=True)
class ExportRequest:
    """What to export: resolved specs, the plan (or its filters) and the config's own settings."""

    training: TrainingSpec
    #: GPUs of the job (DeepSpeed's world size).
    gpus: int
    #: None without ``--params``/``--model`` (an explicit plan needs none).
    model: Optional[ModelSpec] = None
    #: None when nothing needs it (an explicit plan without a model or a layout).
    cluster: Optional[ClusterSpec] = None
    stage: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_param: Optional[str] = None
    checkpointing: Optional[str] = None
    #: The micro-batch (with ``stage``: the explicit plan).
    micro_batch: Optional[int] = None
    sp: Optional[tuple] = None
    tp: Optional[tuple] = None
    tiled_mlp: bool = False
    #: ``--ep`` parsed (:func:`~zeroplan.estimator.expert_parallel.parse_expert_degrees`).
    expert_degrees: Any = None
    cpu_checkpointing: bool = False
    engine: str = "deepspeed"
    optimizer_impl: Optional[str] = None
    #: The plan's bucket fields (and ``overlap_comm``), from the engine options.
    buckets: dict = field(default_factory=dict, hash=False)
    #: Optimizer and scheduler: peak learning rate, warm-up steps, total steps (WarmupDecayLR when given).
    lr: float = 1e-4
    warmup_steps: int = 100
    total_steps: Optional[int] = None
    nvme_path: Optional[str] = None
    #: ``deepspeed`` (the config as DeepSpeed reads it) or ``hf`` ("auto" where HF Trainer fills the value).
    target: str = "deepspeed"
    #: A post-training recipe and its extra models (``zeroplan.profiles.recipe_models``).
    recipe: Any = None
    recipe_models: dict = field(default_factory=dict, hash=False)
    #: Where the config is written, when an accelerate YAML is asked for (it points there).
    accelerate_config_for: Optional[str] = None
    #: How the run saves checkpoints, for the host's save phase (``trainer`` | ``engine``,
    #: :data:`~zeroplan.estimator.host_save.MODEL_SAVES`; None: the Trainer's, as estimate assumes on GPUs).
    model_save: Optional[str] = None
    #: How each rank builds or loads the model, for the host's model-build phase
    #: (:data:`~zeroplan.estimator.host.BUILDS`; None: the engine's default at the plan's stage).
    model_build: Optional[str] = None

    def __post_init__(self) -> None:
        if not engine_facts(self.engine).runs:
            raise SpecError(f"export writes settings for engine {' or '.join(RUNNABLE_ENGINES)}, not {self.engine} "
                            "(an estimate-only engine: zeroplan.spec.engines)")

    @property
    def explicit(self) -> bool:
        return self.stage is not None and self.micro_batch is not None


@dataclass(frozen=True)
class ExportOutcome:
    """The document to write and what to tell the user; ``plan`` None when nothing fits."""

    plan: Optional[Plan]
    #: The JSON document: DeepSpeed's config (``hf``: with "auto" entries) or FSDP settings.
    document: Optional[dict] = None
    #: The line saying which plan was chosen and why (a chosen plan), or why nothing fits.
    chose: Optional[str] = None
    #: Said right after the document is written (``hf``: how to run the Trainer with it).
    written_note: Optional[str] = None
    #: The accelerate YAML's text, when asked for.
    accelerate_yaml: Optional[str] = None
    #: Build notes, layout settings, validation warnings and the fit findings, in that order.
    notes: tuple = ()


def _explicit_plan(r: ExportRequest) -> Plan:
    """The plan the request names, checked against the layout rules and the optimizer implementation."""
    from zeroplan.estimator.expert_parallel import explicit_expert_degree
    from zeroplan.estimator.layout_space import explicit_layout

    layout = explicit_layout(r.sp, r.tp, tiled_mlp=r.tiled_mlp)
    plan = Plan(
        stage=r.stage, offload_optimizer=r.offload_optimizer or "none", offload_param=r.offload_param or "none",
        checkpointing=r.checkpointing or "none", micro_batch=r.micro_batch,
        gradient_accumulation_steps=r.training.accumulation_for(r.micro_batch, Plan(stage=r.stage, **layout).data_parallel(r.gpus)),
        cpu_checkpointing=r.cpu_checkpointing, **layout, ep=explicit_expert_degree(r.expert_degrees, r.model, r.gpus), **r.buckets,
    )
    if plan.model_parallel > 1:
        # The explicit plan obeys the layout rules the plan space enumerates by (not a written
        # config that fails its own validation).
        from zeroplan.estimator.layout_space import check_layout

        check_layout(r.model, r.cluster, r.training, plan, engine=r.engine)
    if r.optimizer_impl is not None:
        from zeroplan.estimator.optimizer import resolve_optimizer_impl

        try:
            resolve_optimizer_impl(r.optimizer_impl, engine=r.engine, plan=plan)
        except SpecError as exc:
            raise SpecError(f"--optimizer-impl: {exc}") from None
    return plan


def choose_export_plan(r: ExportRequest) -> tuple[Optional[Plan], str]:
    """The explicit plan, or the fastest one that fits: (plan or None, the sentence saying why)."""
    if r.explicit:
        return _explicit_plan(r), ""
    if r.model is None:
        raise SpecError(
            "give --stage and --micro-batch for an explicit plan, or a model (--params 7e9 / --model NAME) "
            "so export picks the fastest plan that fits"
        )
    from zeroplan.estimator import best_plan

    choice = best_plan(
        r.model, r.cluster, r.training, stage=r.stage, offload_optimizer=r.offload_optimizer, offload_param=r.offload_param,
        checkpointing=r.checkpointing, engine=r.engine, optimizer_impl=r.optimizer_impl, buckets=r.buckets, sp=r.sp or (1,),
        tp=r.tp or (1,), tiled_mlp=r.tiled_mlp, expert_degrees=r.expert_degrees, recipe=r.recipe, recipe_models=r.recipe_models,
        model_save=r.model_save, model_build=r.model_build,
    )
    if choice.best is None:
        return None, f"no plan fits {r.model.name} on {r.gpus} × {r.cluster.gpu.name}; nothing written (see `zeroplan estimate`)"
    best = choice.best
    plan = best.plan
    if r.cpu_checkpointing and plan.checkpointing != "none":
        plan = replace(plan, cpu_checkpointing=True)
    return plan, (f"chose {plan.label_for(r.engine)}: predicted {best.gpu.required / 1024**3:.1f} GiB per GPU, "
                  f"{best.tokens_per_second:,.0f} tokens/s ({choice.fitting} of {choice.considered} plans fit)")


def run_export(r: ExportRequest) -> ExportOutcome:
    """The plan's config (DeepSpeed's, or FSDP settings under ``engine="fsdp"``), validated.

    A config that fails validation is a bug in :func:`~zeroplan.dsconfig.build_config`, never
    the user's input (RuntimeError); the fit (ZP702), the installed versions' AutoEP check (ZP251)
    and the recipe's rules (ZP95x) judge the user's plan and are returned as notes.
    """
    plan, chose = choose_export_plan(r)
    if plan is None:
        return ExportOutcome(plan=None, chose=chose)
    chose = chose or None
    if engine_facts(r.engine).torch:
        from zeroplan.fsdpconfig import fsdp_settings

        return ExportOutcome(plan=plan, chose=chose,
                             document=fsdp_settings(plan, r.training, world_size=r.gpus, optimizer_impl=r.optimizer_impl))
    from zeroplan.dsconfig import build_config_with_notes, has_errors, validate_config
    from zeroplan.dsconfig.layout_keys import accelerate_parallelism_entries, trainer_layout_settings

    cfg, notes = build_config_with_notes(
        plan, world_size=r.gpus, training=r.training, model=r.model, lr=r.lr, warmup_steps=r.warmup_steps,
        total_steps=r.total_steps, nvme_path=r.nvme_path, optimizer_impl=r.optimizer_impl,
    )
    # An explicit plan is written as asked; the estimator only says whether it fits.
    cluster_for_fit = r.cluster if r.model is not None and r.explicit else None
    findings = validate_config(cfg, world_size=r.gpus, model=r.model, cluster=cluster_for_fit, training=r.training,
                               checkpointing=plan.checkpointing, recipe=r.recipe, model_save=r.model_save,
                               model_build=r.model_build)
    fit = [f for f in findings if f.rule_id in ("ZP702", "ZP251") or f.rule_id.startswith("ZP95")]
    findings = [f for f in findings if f not in fit]
    if has_errors(findings):
        raise RuntimeError("exported config fails validation: " + "; ".join(f.message for f in findings if f.severity == "error"))
    document, written_note = cfg, None
    if r.target == "hf":
        from zeroplan.dsconfig.hf_auto import to_hf_auto, trainer_flags

        document = to_hf_auto(cfg)
        written_note = "Hugging Face Trainer fills the \"auto\" entries; run it with: " + " ".join(trainer_flags(cfg))
    yaml = None
    if r.accelerate_config_for is not None:
        from zeroplan.dsconfig.hf_auto import accelerate_yaml

        yaml = accelerate_yaml(r.accelerate_config_for, num_processes=r.gpus, zero3_init=plan.stage == 3,
                               parallelism=accelerate_parallelism_entries(plan, seq_len=r.training.seq_len))
    notes = notes + trainer_layout_settings(plan) + [f"{f.rule_id}: {f.message}" for f in findings if f.severity == "warning"]
    notes += [f"warning: {f.message}; {f.fix}" if f.severity == "error" else f.message for f in fit]
    return ExportOutcome(plan=plan, document=document, chose=chose, written_note=written_note, accelerate_yaml=yaml, notes=tuple(notes))
