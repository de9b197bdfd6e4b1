"""What ``zeroplan tune`` searches and how it proves its answer — policy the CLI and the
benchmarks share, so both tune the same space and check the winner the same way.

* :func:`tune_space` — the search space for a script: offload targets ``none``/``cpu`` (``nvme``
  only with an NVMe folder), activation checkpointing ``none``/``full`` for a zeroplan task (the
  task's blocks are wrapped by the runtime) but only ``none`` for a plain DeepSpeed script
  (zeroplan cannot make the script's model checkpoint), every stage; a plan flag pins its value.
* :func:`prove_winner` — the best trial's ``ds_config.json`` must pass zeroplan's validation
  and DeepSpeed's own parser (when DeepSpeed is installed) before ``tune`` reports success.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from zeroplan.spec import ClusterSpec, ModelSpec, Plan, SpecError, TrainingSpec
from zeroplan.tuner.space import SearchSpace, build_space

__all__ = ["tune_space", "prove_winner", "script_model_save", "WinnerCheck", "SCRIPT_KINDS"]

#: ``task`` (defines ``zeroplan_task()``) or ``script`` (a plain DeepSpeed script).
SCRIPT_KINDS = ("task", "script")


def tune_space(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    *,
    script_kind: str,
    stage: Optional[int] = None,
    offload_optimizer: Optional[str] = None,
    offload_param: Optional[str] = None,
    checkpointing: Optional[str] = None,
    nvme_path: Optional[str] = None,
    bucket_sizes: Sequence[int] = (),
    max_micro_batch: Optional[int] = None,
    device: Optional[str] = None,
    engine: str = "deepspeed",
    optimizer_impl: Optional[str] = None,
    buckets: Optional[dict] = None,
    base_config: Optional[dict] = None,
    activation_bytes: Optional[Callable[[Plan], int]] = None,
    sp=None,
    tp=None,
    recipe=None,
    ep=None,
    model_save: Optional[str] = None,
    model_build: Optional[str] = None,
) -> SearchSpace:
    """The plans ``tune`` searches (see the module docstring); ``device`` None: ``cuda`` when NVML
    sees a GPU, else ``cpu`` (memory as CPU probes measure it); ``engine`` the one the probes run
    (``deepspeed`` or ``fsdp``), whose memory the estimator models, with ``optimizer_impl``'s step
    and the fixed ``buckets``. ``base_config``: the DeepSpeed config every trial starts from (the
    user's, or the Trainer template); the engine keeps its bucket sizes (DeepSpeed's defaults where
    it leaves a key out, ``"auto"`` to the Hugging Face rule) and its ``overlap_comm`` (DeepSpeed's
    per-stage default where absent), so the plans are estimated with them; ``buckets`` (flags)
    win. ``activation_bytes``: a discovered model's activations where the transformer formula
    does not describe it (its trace). ``sp``/``tp``: the parallel degrees searched (None: 1; a tuple
    or ``"auto"``). ``recipe`` the post-training recipe the plans are estimated under (zeroplan.spec.recipe; None:
    plain SFT). ``ep``: the expert-parallel degrees (:func:`~zeroplan.estimator.expert_parallel.parse_expert_degrees`;
    None: 1). ``model_save``: how the script saves checkpoints (:func:`script_model_save`; None: the
    device's default); ``model_build``: how it builds or loads its model (None: the engine's default
    at each plan; ``zero_init`` narrows an open ``stage`` to 3, as estimate does:
    :func:`~zeroplan.estimator.host.stage_for_build`). SpecError for nvme without a path."""
    if script_kind not in SCRIPT_KINDS:
        raise SpecError(f"script_kind={script_kind!r} is not valid; choose task or script")
    searched = ["none", "cpu"] + (["nvme"] if nvme_path else [])
    opt_targets = [offload_optimizer] if offload_optimizer else searched
    param_targets = [offload_param] if offload_param else searched
    if "nvme" in (*opt_targets, *param_targets) and not nvme_path:
        raise SpecError("nvme offload needs --nvme-path DIR (a folder on the NVMe drive)")
    ckpts = [checkpointing] if checkpointing else (["none", "full"] if script_kind == "task" else ["none"])
    if device is None:
        from zeroplan.tuner.checks import cuda_visible

        device = "cuda" if cuda_visible() else "cpu"
    from zeroplan.estimator.host import stage_for_build

    stage = stage_for_build(stage, model_build)
    return build_space(
        model,
        cluster,
        training,
        stages=(stage,) if stage is not None else None,
        offload_optimizer=opt_targets,
        offload_param=param_targets,
        checkpointing=ckpts,
        bucket_sizes=bucket_sizes,
        device=device,
        engine=engine,
        optimizer_impl=optimizer_impl,
        buckets=_with_base_buckets(buckets, base_config) if engine == "deepspeed" else buckets,
        overlap_comm_of=_overlap_comm_of(base_config) if engine == "deepspeed" else None,
        activation_bytes=activation_bytes,
        sp=sp or (1,),
        tp=tp or (1,),
        **({"max_micro_batch": max_micro_batch} if max_micro_batch is not None else {}),
        recipe=recipe,
        ep=ep,
        model_save=model_save,
        model_build=model_build,
    )


def script_model_save(*, trainer: bool, given: Optional[str] = None) -> str:
    """How a tuned script saves its checkpoints, for the host's save phase of its plans:
    ``given`` (``--model-save``) when set, else ``trainer`` for a Hugging Face Trainer script (its
    ``save_model`` copies the 16-bit model to the host on every rank at ZeRO 0-2:
    :func:`zeroplan.estimator.host_save.trainer_save_bytes`) and ``engine`` for a plain DeepSpeed
    script or a zeroplan task (``engine.save_checkpoint``: the step's buffers, written in place)."""
    if given is not None:
        return given
    return "trainer" if trainer else "engine"


def _with_base_buckets(buckets: Optional[dict], base_config: Optional[dict]) -> Optional[dict]:
    """The fixed bucket fields: the flags' (``buckets``), else the sizes DeepSpeed runs
    ``base_config`` with (:func:`zeroplan.dsconfig.plan.bucket_sizes_from_config`); ``"auto"``
    stays unset (the estimator's Hugging Face rule, as the Trainer fills it)."""
    if base_config is None:
        return buckets
    from zeroplan.dsconfig.plan import bucket_sizes_from_config

    out = {field: value for field, value in bucket_sizes_from_config(base_config).items() if value is not None}
    out.update(buckets or {})
    return out


def _overlap_comm_of(base_config: Optional[dict]):
    """Stage → ``overlap_comm`` as DeepSpeed runs ``base_config`` (None without a base: the plan's own,
    which the config zeroplan builds writes)."""
    if base_config is None:
        return None
    from zeroplan.dsconfig.plan import overlap_comm_from_config

    return lambda stage: overlap_comm_from_config(base_config, stage)


@dataclass(frozen=True)
class WinnerCheck:
    """The final validation of the best config."""

    errors: tuple[str, ...]
    """``ZPnnn: message`` for each zeroplan error, and DeepSpeed's parser error if any."""
    checked_by_deepspeed: bool
    """False when DeepSpeed is not installed or the config keeps "auto" entries (its parser did not run)."""
    keeps_auto: bool = False
    """The config keeps Hugging Face "auto" entries, which only Trainer/accelerate resolve; the
    winner's own run resolved them, so DeepSpeed's parser is not asked about the raw file."""

    @property
    def ok(self) -> bool:
        return not self.errors


def prove_winner(config_path: Path, *, world_size: int) -> WinnerCheck:
    """Validate the winner's config with zeroplan's rules and DeepSpeed's ``DeepSpeedConfig``
    (in a child process, :func:`zeroplan.tuner.checks.deepspeed_parse_error`)."""
    from zeroplan.dsconfig import load_config, validate_config
    from zeroplan.tuner.checks import deepspeed_installed, deepspeed_parse_error

    cfg = load_config(config_path).config
    errors = [f"{f.rule_id}: {f.message}" for f in validate_config(cfg, world_size=world_size) if f.severity == "error"]
    keeps_auto = _has_auto(cfg)
    checked = deepspeed_installed() and not keeps_auto
    if checked:
        ds_error = deepspeed_parse_error(cfg, world_size=world_size)
        if ds_error:
            errors.append(ds_error)
    return WinnerCheck(errors=tuple(errors), checked_by_deepspeed=checked, keeps_auto=keeps_auto)


def _has_auto(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_has_auto(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_auto(v) for v in value)
    return value == "auto"
