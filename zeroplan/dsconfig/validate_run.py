"""The validate use case: a read config and the user's context in, every finding out.

``zeroplan validate`` reads the config (:func:`~zeroplan.dsconfig.load_config`), parses its own
options into a :class:`ValidateRequest` and renders the :class:`ValidateOutcome`. With a model the
fit is checked too, on the GPUs given or the count the batch keys imply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from zeroplan.spec import ClusterSpec, ModelSpec, SpecError, TrainingSpec

__all__ = ["ValidateOutcome", "ValidateRequest", "config_precision", "implied_world_size", "run_validate"]


def implied_world_size(cfg: dict) -> int | None:
    """GPU count the three batch keys are consistent with, if they are whole numbers: the batch
    world times ``sequence_parallel_size`` (DeepSpeed's batch assertion divides the world by it)."""
    values = [cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    tb, mb, ga = values
    sp = cfg.get("sequence_parallel_size")
    sp = sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1 else 1
    return tb // (mb * ga) * sp if tb % (mb * ga) == 0 else None


def config_precision(cfg: dict) -> str:
    """bf16, fp16 or fp32 as the config enables them (a quantized base needs bf16/fp16)."""
    return "bf16" if (cfg.get("bf16") or {}).get("enabled") else ("fp16" if (cfg.get("fp16") or {}).get("enabled") else "fp32")


@dataclass(frozen=True)
class ValidateRequest:
    """A read config (:class:`~zeroplan.dsconfig.parse.ParsedConfig`) and what the run adds to it."""

    parsed: Any
    #: GPUs (ranks) the job launches; None: not given (the batch keys may imply it).
    gpus: Optional[int] = None
    seq_len: int = 2048
    checkpointing: Optional[str] = None
    #: The run's sequence- and tensor-parallel degrees when the config does not name them.
    sp: Optional[int] = None
    tp: Optional[int] = None
    recipe: Any = None
    #: With a model: its spec at a precision (the config's), for the fit; None: no fit check.
    model_for: Optional[Callable[[str], ModelSpec]] = None
    #: The cluster on a number of GPUs (the fit needs one when a model is given).
    cluster_for: Optional[Callable[[int], ClusterSpec]] = None
    #: DS_ACCELERATOR of the run: the CUDA-only features' rules (ZP208-ZP211) need it.
    accelerator: Optional[str] = None
    #: How the run saves checkpoints and builds its model, for the fit's host phases (``--model-save``,
    #: ``--model-build``; None: the estimator's defaults, as estimate takes them).
    model_save: Optional[str] = None
    model_build: Optional[str] = None


@dataclass(frozen=True)
class ValidateOutcome:
    findings: list
    #: The model the fit was checked with, or None.
    model: Optional[ModelSpec] = None
    #: What the user should know about how it was checked (the cluster's notes, the GPU count used).
    notes: tuple = ()


def run_validate(r: ValidateRequest) -> ValidateOutcome:
    """Every rule on the config (:func:`~zeroplan.dsconfig.validate_config`), the fit with a model."""
    from zeroplan.dsconfig import validate_config
    from zeroplan.dsconfig.layout_keys import with_layout

    cfg = r.parsed.config
    if r.model_build is not None:
        from zeroplan.estimator.usecase import check_model_build

        # The stage is the config's (DeepSpeed's default 0 when absent; a stage no rule accepts is left to them).
        zero = cfg.get("zero_optimization")
        stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
        check_model_build(r.model_build, engine="deepspeed", stage=stage if isinstance(stage, int) else None,
                          stage_from="the config's zero_optimization.stage")
    model = cluster = None
    notes: list[str] = []
    if r.model_for is not None:
        model = r.model_for(config_precision(cfg))
        cluster_gpus = r.gpus or implied_world_size(cfg)
        if cluster_gpus is None:
            notes.append("memory fit not checked: give --gpus N (the batch keys do not fix a GPU count)")
        else:
            cluster = r.cluster_for(cluster_gpus)
            notes.extend(cluster.notes)
            if r.gpus is None:
                notes.append(f"fit checked on {cluster_gpus} GPUs, the count the batch keys imply (set --gpus)")
    for name, value in (("--sp", r.sp), ("--tp", r.tp)):
        if value is not None and value < 1:
            raise SpecError(f"{name} {value} is not valid; give a degree >= 1")
    findings = validate_config(
        with_layout(cfg, sp=r.sp, tp=r.tp), world_size=r.gpus, model=model, cluster=cluster, training=TrainingSpec(seq_len=r.seq_len),
        checkpointing=r.checkpointing, duplicate_keys=r.parsed.duplicate_keys, syntax=r.parsed.syntax, accelerator=r.accelerator,
        recipe=r.recipe, model_save=r.model_save, model_build=r.model_build,
    )
    return ValidateOutcome(findings=findings, model=model, notes=tuple(notes))
