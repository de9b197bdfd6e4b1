"""Option groups: the options several commands share, declared once per group and resolved once.

Each group is a frozen dataclass whose fields carry their typer option (the ``Annotated`` aliases
of :mod:`zeroplan.cli.common`); a command takes whole groups::

    @app.command()
    @grouped
    def estimate(model_opts: ModelOptions, cluster_opts: ClusterOptions, ..., top: TopOpt = 20): ...

:func:`grouped` gives typer one option per field (what the command line and ``-h`` show) and
hands the command one group object per parameter. ``Annotated[ClusterOptions, Take(...)]``
picks the fields a command takes and how it spells or defaults them differently (``--gpus`` with
the 2-rank default on the commands that run engines here). Each group's ``resolve`` turns the
raw values into the spec the library takes (:class:`~zeroplan.spec.ModelSpec`,
:class:`~zeroplan.spec.ClusterSpec`, :class:`~zeroplan.spec.TrainingSpec`, the plan filters,
:class:`~zeroplan.spec.recipe.Recipe`); every bad value is a :class:`~zeroplan.spec.SpecError`
naming the option.

Groups: model, cluster, training, plan, fine-tuning (PEFT), engine and recipe. ``--engine``
(deepspeed | fsdp) is the one name of the engine on every command; probe and tune also take their
old spelling ``--backend``, hidden from ``-h``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Annotated, Any, Optional, get_args, get_origin, get_type_hints

import typer

from zeroplan.cli import common as c
from zeroplan.cli import recipe_options as r
from zeroplan.cli.expert_option import EpOpt
from zeroplan.cli.context_option import CpOpt
from zeroplan.spec import SpecError

__all__ = [
    "ClusterOptions",
    "EngineOptions",
    "EngineOpt",
    "ModelOptions",
    "OptionGroup",
    "PeftGroup",
    "PlanOptions",
    "RecipeOptions",
    "Take",
    "TrainingOptions",
    "grouped",
]


def _opt(alias: Any, default: Any = None) -> Any:
    """A group field: its default and, in the metadata, its typer option."""
    return field(default=default, metadata={"option": alias})


@dataclass(frozen=True)
class Take:
    """Which of a group's options a command takes (``only``, in the group's order) and the
    spellings (``options``: field → ``Annotated`` alias) and defaults (``defaults``) it changes."""

    only: Optional[tuple[str, ...]] = None
    options: dict = field(default_factory=dict, hash=False)
    defaults: dict = field(default_factory=dict, hash=False)


class OptionGroup:
    """Base of the option groups (a marker :func:`grouped` looks for).

    A group is built once per command run and read field by field: the groups are declared with
    ``eq=False, repr=False``, so the dataclass decorator does not compile an ``__eq__``,
    ``__hash__`` and ``__repr__`` per group at every start-up (each compiled method costs about
    as much as importing a small module)."""

    @classmethod
    def from_parsed(cls, values: dict[str, Any], *, given: frozenset[str]) -> "OptionGroup":
        """The group from its options' parsed values; ``given`` names the options the command line
        (or the environment) set, as opposed to those left at their default."""
        return cls(**values)

    @classmethod
    def options(cls, take: Take) -> list[tuple[str, Any, Any]]:
        """(field, typer annotation, default) for each option the command takes."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = set(take.only or ()) | set(take.options) | set(take.defaults)
        assert unknown <= set(names), f"{cls.__name__} has no {sorted(unknown - set(names))}"
        out = []
        for f in dataclasses.fields(cls):
            if take.only is not None and f.name not in take.only:
                continue
            out.append((f.name, take.options.get(f.name, f.metadata["option"]), take.defaults.get(f.name, f.default)))
        return out


# --------------------------------------------------------------------------------------- model
@dataclass(frozen=True, eq=False, repr=False)
class ModelOptions(OptionGroup):
    """``--params`` / ``--model``: the model to plan for."""

    params: Optional[float] = _opt(c.ParamsOpt)
    model: Optional[str] = _opt(c.ModelOpt)

    @property
    def given(self) -> bool:
        return self.params is not None or self.model is not None

    def resolve(self, peft: "PeftGroup", *, precision: str):
        """The ModelSpec with the fine-tuning layout applied (:func:`zeroplan.profiles.resolve.resolve_model`)."""
        return peft.spec().apply(c.resolve_model(self.params, self.model), self.model, precision=precision)


# ------------------------------------------------------------------------------------- cluster
@dataclass(frozen=True, eq=False, repr=False)
class ClusterOptions(OptionGroup):
    """GPUs, their profile and memory, and each node's host RAM and NVMe."""

    gpus: Optional[int] = _opt(c.GpusOpt)
    gpus_per_node: Optional[int] = _opt(c.GpusPerNodeOpt)
    gpu: Optional[str] = _opt(c.GpuOpt)
    gpu_memory: Optional[float] = _opt(c.GpuMemoryOpt)
    cpu_memory: Optional[str] = _opt(c.CpuMemoryOpt)
    node: Optional[str] = _opt(c.NodeOpt)
    nvme: Optional[float] = _opt(c.NvmeOpt)

    def world(self, *, runs_here: bool) -> int:
        """``--gpus`` or its default (:func:`zeroplan.cli.common.resolve_gpus`)."""
        return c.resolve_gpus(self.gpus, runs_here=runs_here)

    def resolve(self, gpus: int):
        """The ClusterSpec on ``gpus`` GPUs (:func:`zeroplan.profiles.resolve.resolve_cluster`)."""
        return c.resolve_cluster(gpus=gpus, gpus_per_node=self.gpus_per_node, gpu=self.gpu, gpu_memory_gib=self.gpu_memory,
                                 cpu_memory_gib=self.cpu_memory, nvme_gib=self.nvme, node=self.node)


# ------------------------------------------------------------------------------------ training
@dataclass(frozen=True, eq=False, repr=False)
class TrainingOptions(OptionGroup):
    """Sequence, batch, precision and optimizer."""

    seq_len: Optional[int] = _opt(c.SeqLenOpt, 2048)
    micro_batch: Optional[int] = _opt(c.MicroBatchOpt)
    global_batch: Optional[int] = _opt(c.GlobalBatchOpt)
    grad_accum: Optional[int] = _opt(c.GradAccumOpt)
    precision: str = _opt(c.PrecisionOpt, "bf16")
    optimizer: str = _opt(c.OptimizerOpt, "adamw")

    def resolve(self):
        """The TrainingSpec (:func:`zeroplan.profiles.resolve.resolve_training`)."""
        return c.resolve_training(precision=self.precision, optimizer=self.optimizer, seq_len=self.seq_len,
                                  micro_batch=self.micro_batch, global_batch=self.global_batch, grad_accum=self.grad_accum)


# ---------------------------------------------------------------------------------------- plan
@dataclass(frozen=True, eq=False, repr=False)
class PlanOptions(OptionGroup):
    """The plan filters: stage, offloads, checkpointing and the parallel layout."""

    stage: Optional[int] = _opt(c.StageOpt)
    offload_optimizer: Optional[str] = _opt(c.OffloadOptimizerOpt)
    offload_param: Optional[str] = _opt(c.OffloadParamOpt)
    checkpointing: Optional[str] = _opt(c.CheckpointingOpt)
    sp: Optional[str] = _opt(c.SpOpt)
    tp: Optional[str] = _opt(c.TpOpt)
    tiled_mlp: bool = _opt(c.TiledMlpOpt, False)
    ep: Optional[str] = _opt(EpOpt)
    cp: Optional[str] = _opt(CpOpt)

    def check(self) -> None:
        """The spellings of stage, offloads and checkpointing (combinations: :class:`~zeroplan.spec.Plan`)."""
        c.check_plan_options(stage=self.stage, offload_optimizer=self.offload_optimizer, offload_param=self.offload_param,
                             checkpointing=self.checkpointing)

    def layout(self) -> tuple:
        """``--sp``/``--tp`` degrees (None where not given)."""
        return c.resolve_layout_options(self.sp, self.tp)

    def context_degrees(self):
        """``--cp`` degrees (None where not given; :func:`~zeroplan.estimator.layout_space.parse_degrees`)."""
        from zeroplan.estimator.layout_space import parse_degrees

        return None if self.cp is None else parse_degrees("--cp", self.cp)


# --------------------------------------------------------------------------------- fine-tuning
@dataclass(frozen=True, eq=False, repr=False)
class PeftGroup(OptionGroup):
    """LoRA / QLoRA: adapters on a frozen base."""

    lora_rank: Optional[int] = _opt(c.LoraRankOpt)
    lora_targets: Optional[str] = _opt(c.LoraTargetsOpt)
    lora_alpha: Optional[float] = _opt(c.LoraAlphaOpt)
    adapter: Optional[Any] = _opt(c.AdapterOpt)
    trainable_params: Optional[str] = _opt(c.TrainableParamsOpt)
    base_quant: Optional[str] = _opt(c.BaseQuantOpt)

    def spec(self) -> c.PeftOptions:
        return c.PeftOptions(self.lora_rank, self.lora_targets, self.lora_alpha, self.adapter, self.trainable_params, self.base_quant)


# -------------------------------------------------------------------------------------- engine
#: ``--engine`` on every command; the help says what the choice means where it is used.
EngineOpt = Annotated[
    str,
    typer.Option("--engine", help="deepspeed (ZeRO as DeepSpeed runs it) | fsdp (PyTorch: DDP for stage 0, ZeroRedundancyOptimizer for 1, FSDP2 fully_shard for 2-3) | fsdp1 (estimate only: FSDP1 per block, use_orig_params: flat parameters at 2-3).", rich_help_panel="Plan"),
]
#: The old spelling on probe and tune: accepted, not shown.
BackendAliasOpt = Annotated[Optional[str], typer.Option("--backend", hidden=True, help="Old name of --engine.")]


@dataclass(frozen=True, eq=False, repr=False)
class EngineOptions(OptionGroup):
    """The engine and what depends on it: optimizer implementation, loss, buckets, overlap, and the
    two questions of the host's memory that the run answers, not the plan: how it builds or loads
    the model (``--model-build``) and how it saves checkpoints (``--model-save``: the Trainer's save
    or the engine's own). estimate, export, validate and tune take both, so each one's host verdict
    answers the same flags alike; probe takes neither (it measures the script's own build and save)."""

    optimizer_impl: Optional[str] = _opt(c.OptimizerImplOpt)
    loss: Optional[str] = _opt(c.LossOpt)
    buckets: str = _opt(c.BucketsOpt, "hf")
    reduce_bucket_size: Optional[float] = _opt(c.ReduceBucketOpt)
    allgather_bucket_size: Optional[float] = _opt(c.AllgatherBucketOpt)
    prefetch_bucket_size: Optional[float] = _opt(c.PrefetchBucketOpt)
    overlap_comm: Optional[str] = _opt(c.OverlapCommOpt)
    engine: str = _opt(EngineOpt, "deepspeed")
    backend: Optional[str] = _opt(BackendAliasOpt)
    model_save: Optional[str] = _opt(c.ModelSaveOpt)
    model_build: Optional[str] = _opt(c.ModelBuildOpt)

    @classmethod
    def from_parsed(cls, values: dict[str, Any], *, given: frozenset[str]) -> "EngineOptions":
        """Also refuses ``--backend`` beside an ``--engine`` that names another engine, default
        value included (``--backend fsdp --engine deepspeed``)."""
        group = cls(**values)
        if "engine" in given:
            group._check_alias(engine_given=True)
        return group

    def _check_alias(self, *, engine_given: bool) -> None:
        if self.backend is not None and engine_given and self.backend != self.engine:
            raise SpecError(f"--backend {self.backend} and --engine {self.engine} disagree; give one of them: --engine deepspeed|fsdp "
                            "(--backend is its old name)")

    @property
    def name(self) -> str:
        """deepspeed or fsdp: ``--engine``, or the old ``--backend`` when that was given (an
        ``--engine`` other than the default that disagrees with it: SpecError)."""
        self._check_alias(engine_given=self.engine != "deepspeed")
        return self.backend if self.backend is not None else self.engine

    @property
    def flag(self) -> str:
        """The spelling the user gave, for messages."""
        return "--backend" if self.backend is not None else "--engine"

    @property
    def bucket_flags_given(self) -> bool:
        return self.buckets != "hf" or any(v is not None for v in (self.reduce_bucket_size, self.allgather_bucket_size, self.prefetch_bucket_size))

    def check_host(self, *, stage: Optional[int]) -> None:
        """``--model-save`` (:data:`~zeroplan.estimator.host_save.MODEL_SAVES`) and ``--model-build``
        at ``stage`` (None: any; :func:`~zeroplan.estimator.usecase.check_model_build`)."""
        from zeroplan.estimator.host_save import MODEL_SAVES
        from zeroplan.estimator.usecase import check_model_build

        c.check_choice_option("--model-save", self.model_save, MODEL_SAVES)
        check_model_build(self.model_build, engine=self.name, stage=stage)

    def resolve(self, plan: Optional[PlanOptions] = None) -> dict:
        """The checks of :func:`zeroplan.cli.common.resolve_engine_options` and of the host options
        (:meth:`check_host` at the plan's ``--stage``); the plan's bucket fields."""
        self.check_host(stage=plan.stage if plan else None)
        return c.resolve_engine_options(
            engine=self.name, engine_flag=self.flag, optimizer_impl=self.optimizer_impl, loss=self.loss,
            offload_optimizer=plan.offload_optimizer if plan else None, offload_param=plan.offload_param if plan else None,
            buckets=self.buckets, reduce_bucket_size=self.reduce_bucket_size, allgather_bucket_size=self.allgather_bucket_size,
            prefetch_bucket_size=self.prefetch_bucket_size, overlap_comm=self.overlap_comm,
        )


# -------------------------------------------------------------------------------------- recipe
@dataclass(frozen=True, eq=False, repr=False)
class RecipeOptions(OptionGroup):
    """``--recipe`` and its settings (docs/recipes.md)."""

    recipe: Optional[str] = _opt(r.RecipeOpt)
    generations: Optional[int] = _opt(r.GenerationsOpt)
    completion_len: Optional[int] = _opt(r.CompletionLenOpt)
    vllm_gpu_memory: Optional[float] = _opt(r.VllmGpuMemoryOpt)
    vllm_sleep: bool = _opt(r.VllmSleepOpt, False)
    reference: Optional[str] = _opt(r.ReferenceOpt)
    reward_model: Optional[str] = _opt(r.RewardModelOpt)
    critic_model: Optional[str] = _opt(r.CriticModelOpt)

    def resolve(self):
        """The Recipe, or None when no recipe option is given (:func:`zeroplan.cli.recipe_options.resolve_recipe`)."""
        return r.resolve_recipe(self.recipe, generations=self.generations, completion_len=self.completion_len,
                                vllm_gpu_memory=self.vllm_gpu_memory, vllm_sleep=self.vllm_sleep, reference=self.reference,
                                reward_model=self.reward_model, critic_model=self.critic_model)


# ------------------------------------------------------------------------------------ decorator
def _group_of(hint: Any) -> tuple[Optional[type], Take]:
    if get_origin(hint) is Annotated:
        base, *extras = get_args(hint)
        if isinstance(base, type) and issubclass(base, OptionGroup):
            takes = [e for e in extras if isinstance(e, Take)]
            return base, takes[0] if takes else Take()
    if isinstance(hint, type) and issubclass(hint, OptionGroup):
        return hint, Take()
    return None, Take()


def _given_options() -> frozenset[str]:
    """The parameters of the running command that its command line or environment set (click's
    parameter source); empty outside a click context (a command called as a function)."""
    from typer._click.core import ParameterSource
    from typer._click.globals import get_current_context

    ctx = get_current_context(silent=True)
    if ctx is None:
        return frozenset()
    return frozenset(n for n in ctx.params if ctx.get_parameter_source(n) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT))


def grouped(func):
    """A command whose group parameters (``model_opts: ModelOptions``) typer sees as their options.

    The options appear in the order of the groups and, within a group, of its fields; ``-h``
    lists them under their ``rich_help_panel``. The command receives one group object each.
    """
    hints = get_type_hints(func, include_extras=True)
    params: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}
    for p in inspect.signature(func).parameters.values():
        group, take = _group_of(hints.get(p.name))
        if group is None:
            params.append(p.replace(annotation=hints.get(p.name, p.annotation), kind=inspect.Parameter.KEYWORD_ONLY))
            continue
        names = []
        for name, annotation, default in group.options(take):
            params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
            names.append(name)
        groups[p.name] = (group, names, take.defaults)
    seen = [p.name for p in params]
    assert len(seen) == len(set(seen)), f"{func.__name__}: an option name is used twice: {sorted(n for n in seen if seen.count(n) > 1)}"

    @functools.wraps(func)
    def command(**kwargs):
        given = _given_options()
        for name, (group, names, _) in groups.items():
            kwargs[name] = group.from_parsed({n: kwargs.pop(n) for n in names}, given=given)
        return func(**kwargs)

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    del command.__wrapped__  # typer reads __signature__, not the grouped function's own
    return command
