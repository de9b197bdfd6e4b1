"""A trial's evaluation: build the DeepSpeed JSON for a plan, run one probe, report what it measured.

The tuner never calls the runtime directly; it calls a *runner* — any callable
``runner(plan, *, trial_number, on_line) -> ProbeOutcome`` — so the same search drives real probes
(:class:`ProbeRunner`) and the benchmark's exhaustive grid uses exactly the same measurements.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from zeroplan.runtime.api import STATUSES
from zeroplan.spec import ModelSpec, Plan, SpecError, TrainingSpec

__all__ = ["ProbeOutcome", "ProbeRunner", "Runner", "PROBE_STATUSES", "PROBED_STATUSES", "begin_warm_server", "check_tune_precision", "launch_request"]

#: Statuses a probe can end with (the runtime's, plus "invalid" for a config that fails validation).
PROBE_STATUSES = (*STATUSES, "invalid")

#: Statuses of trials that ran a probe (they count against --trials).
PROBED_STATUSES = STATUSES


@dataclass(frozen=True)
class ProbeOutcome:
    """What one trial's probe measured (or why it failed)."""

    status: str
    """ok | oom | error | timeout | invalid (the built config failed validation; nothing ran)."""
    samples_per_second: float = 0.0
    """Measured samples/s over all ranks (0 unless ok)."""
    tokens_per_second: float = 0.0
    """Measured tokens/s over all ranks (0 when the script does not report tokens)."""
    step_time_s: float = 0.0
    """Mean measured optimizer-step time, seconds."""
    peak_memory_bytes: int = 0
    """Largest per-rank peak allocated memory, bytes."""
    peak_memory_per_rank_bytes: tuple[int, ...] = ()
    """Peak allocated memory of each rank, bytes."""
    error: str = ""
    """One line saying what went wrong (empty when ok)."""
    log_tail: str = ""
    """Last lines of the probe's output."""
    wall_s: float = 0.0
    """Wall time of the probe including launch, seconds."""
    ds_config: dict = field(default_factory=dict)
    """The DeepSpeed JSON the probe ran with."""
    trl: dict = field(default_factory=dict)
    """A Trainer script's config values as it ran (TRL's field names: batch, recipe, precision); empty otherwise."""
    engine_ready: Optional[bool] = None
    """The engine was built (``deepspeed.initialize`` returned); None: unknown (no progress lines)."""
    optimizer_steps: int = 0
    """Optimizer steps done, warm-up included (from the worker's progress lines)."""
    startup_s: Optional[float] = None
    """Seconds from the worker's start to a built engine (imports, engine build, op compilation)."""
    host_peak_per_node_bytes: int = 0
    """Peak host RSS of the node during the probe (sampled), bytes; 0 when not measured."""
    host_peak_per_rank_bytes: tuple[int, ...] = ()
    """Peak RSS of each rank, bytes."""
    estimated_host_peak_per_node_bytes: int = 0
    """The estimator's host peak per node for the probe, bytes; 0 when not estimated."""
    memory_limit: str = ""
    """For an ``oom``: ``host`` or ``device``."""
    cpu_step_time_s: Optional[float] = None
    """CPU seconds per step of the busiest rank (``zeroplan.runtime.ProbeResult.cpu_step_time``)."""
    load_average: Optional[tuple[float, float]] = None
    """The machine's 1-minute load average at the probe's start and report."""
    step_time_ci_s: Optional[float] = None
    """Half-width of the step time's 95% confidence interval, seconds (micro-step measurement)."""
    micro_steps: int = 0
    """Micro-steps the step time rests on (0: whole optimizer steps were timed)."""
    timeout_s: float = 0.0
    """The timeout this probe ran under, seconds."""
    timeout_derived: bool = False
    """That timeout was derived from earlier probes (shorter than --timeout)."""
    launcher: str = ""
    """What started the ranks (``warm``, ``torchrun``; empty for several nodes or when unknown)."""
    phases_s: dict = field(default_factory=dict)
    """Wall seconds per phase of the probe (``zeroplan.runtime.measure.phases.PHASES``)."""
    waits_s: dict = field(default_factory=dict)
    """Seconds of waits that are not the plan's, not charged to its timeout (``launcher``, ``op build``)."""
    retried: str = ""
    """Why the probe was run a second time (its first run failed for a reason outside the plan); empty: once."""

    @property
    def plan_wall_s(self) -> float:
        """Wall seconds charged to the plan: ``wall_s`` less the waits that are not its own."""
        return max(self.wall_s - sum(self.waits_s.values()), 0.0)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def as_dict(self) -> dict:
        d = asdict(self)
        d["peak_memory_per_rank_bytes"] = list(self.peak_memory_per_rank_bytes)
        d["host_peak_per_rank_bytes"] = list(self.host_peak_per_rank_bytes)
        return d


def check_tune_precision(precision: str) -> None:
    """SpecError for bf16-pure: every trial, and the winner tune hands back, is a DeepSpeed config
    (checked by DeepSpeed's parser, whichever backend probes it), and DeepSpeed has no bf16-pure
    zeroplan models (:func:`zeroplan.estimator.plans.check_engine_precision`)."""
    if precision == "bf16-pure":
        raise SpecError(
            "tune writes each trial and its winner as a DeepSpeed config, which has no bf16-pure; measure bf16-pure plans "
            "with zeroplan probe --backend fsdp --precision bf16-pure, or use --precision bf16"
        )


class Runner(Protocol):
    def __call__(self, plan: Plan, *, trial_number: int, on_line: Optional[Callable[[str], None]] = None) -> ProbeOutcome: ...


@dataclass
class ProbeRunner:
    """Runs a real probe (``zeroplan.runtime.run_probe``) for each plan, one workdir per trial."""

    script: Path
    """The training script (a DeepSpeed script or a zeroplan task)."""
    nproc: int
    """Processes (ranks) per probe."""
    training: TrainingSpec
    model: Optional[ModelSpec]
    workdir: Path
    """Folder under which each trial gets ``trial-<n>/`` (config, logs)."""
    backend: str = "deepspeed"
    script_args: tuple[str, ...] = ()
    config_arg: str = "--deepspeed_config"
    """The flag that passes the DeepSpeed JSON to a DeepSpeed script (``--deepspeed`` for HF Trainer)."""
    steps: int = 3
    """Measured optimizer steps (the most, with ``target_ci``)."""
    warmup: int = 1
    timeout_s: float = 300.0
    """The ceiling of every probe's timeout (--timeout)."""
    nvme_path: Optional[str] = None
    torchrun_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    nodes: Any = None
    base_config: Optional[dict] = None
    """The user's DeepSpeed config (or the Trainer template): each trial is it with the tuned keys
    replaced (zeroplan.dsconfig.trial.apply_plan_config); None: zeroplan's complete config."""
    """``zeroplan.runtime.launch.multinode.NodeLaunch`` for probes across nodes (``nproc`` is then per node)."""

    def __post_init__(self) -> None:
        check_tune_precision(self.training.precision)

    @property
    def world_size(self) -> int:
        """Ranks in each probe: ``nproc`` per node × nodes."""
        return self.nproc * (self.nodes.nnodes if self.nodes is not None else 1)
    target_ci: Optional[float] = None
    """Stop measuring once the step time's 95% half-width is this fraction of it (micro-steps
    timed where accumulation is large); None: time ``steps`` whole optimizer steps."""
    predicted_step_time: Optional[Callable[[Plan], Optional[float]]] = None
    """The estimator's step time for a plan; with it each probe's timeout is derived from the
    probes that worked (:func:`zeroplan.tuner.probetime.probe_timeout`)."""
    optimizer_impl: Optional[str] = None
    """Whose optimizer step runs (``torch``/``torch-fused`` set the trial config's ``torch_adam``);
    None: the config's own choice, which the probe's estimate discovers."""
    loss: Optional[str] = None
    """What the loss keeps over the logits, for the probes' estimates; None: the task's own."""
    launcher: str = "warm"
    """How a one-node probe starts its ranks (``zeroplan.runtime.LOCAL_LAUNCHERS``: ``warm`` forks them
    from a process that imported torch and DeepSpeed once; ``torchrun``)."""
    history: list = field(default_factory=list)
    """:class:`zeroplan.tuner.probetime.ProbeTiming` of every probe that worked."""
    startup_floor_s: Optional[float] = None
    """Predicted start-up of a probe before any worked (:func:`zeroplan.tuner.probetime.startup_floor_s`):
    with it the first probes get a derived timeout too (:func:`zeroplan.tuner.probetime.first_probe_timeout`)."""

    def _request(self, **fields) -> Any:
        return launch_request(script=self.script, nproc=self.nproc, backend=self.backend, torchrun_args=tuple(self.torchrun_args),
                              env=self.env, nodes=self.nodes, launcher=self.launcher, target_ci=self.target_ci, **fields)

    def begin_warm_server(self) -> Callable[[], Optional[float]]:
        """:func:`begin_warm_server` for this runner's probes."""
        return begin_warm_server(self._request(), workdir=self.workdir, ready_timeout_s=self.timeout_s)

    def expected_s(self, plan: Plan) -> Optional[float]:
        """Expected wall time of a probe of ``plan`` from the probes that worked (None before any)."""
        from zeroplan.tuner.probetime import expected_probe_s

        predicted = self.predicted_step_time(plan) if self.predicted_step_time else None
        if not predicted:
            return None
        return expected_probe_s(predicted, self.history, optimizer_steps=self.warmup + self.steps, startup_class=plan.zero_label)

    def timeout_for(self, plan: Plan) -> tuple[float, bool]:
        """(timeout, derived?) for a probe of ``plan``."""
        from zeroplan.tuner.probetime import probe_timeout

        predicted = self.predicted_step_time(plan) if self.predicted_step_time else None
        if not predicted:
            return self.timeout_s, False
        return probe_timeout(
            predicted, self.history, ceiling_s=self.timeout_s, optimizer_steps=self.warmup + self.steps, startup_s=self.startup_floor_s,
            startup_class=plan.zero_label,
        )

    def build_config(self, plan: Plan) -> tuple[dict, list[str]]:
        """The trial's DeepSpeed JSON and the validation errors it has (empty: valid)."""
        from zeroplan.dsconfig import build_config, validate_config

        cfg = build_config(plan, world_size=self.world_size, training=self.training, model=self.model, nvme_path=self.nvme_path,
                           optimizer_impl=self.optimizer_impl)
        if self.base_config is not None:
            from zeroplan.dsconfig.trial import apply_plan_config

            cfg = apply_plan_config(self.base_config, cfg, plan)
        findings = validate_config(
            cfg, world_size=self.world_size, model=self.model, training=self.training, checkpointing=plan.checkpointing
        )
        errors = [f"{f.rule_id}: {f.message}" for f in findings if f.severity == "error"]
        return cfg, errors

    def __call__(self, plan: Plan, *, trial_number: int, on_line: Optional[Callable[[str], None]] = None) -> ProbeOutcome:
        from zeroplan.runtime import run_probe
        from zeroplan.tuner.failures import outside_plan

        start = time.monotonic()
        cfg, errors = self.build_config(plan)
        if errors:
            return ProbeOutcome(status="invalid", error="; ".join(errors), ds_config=cfg)
        timeout_s, derived = self.timeout_for(plan)
        trial_dir = self.workdir / f"trial-{trial_number:04d}"
        run = 1
        while (trial_dir / "result.json").exists():  # the plan measured again: keep the first run's files
            run += 1
            trial_dir = self.workdir / f"trial-{trial_number:04d}-run{run}"
        trial_dir.mkdir(parents=True, exist_ok=True)
        (trial_dir / "ds_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        request = self._request(
            ds_config=cfg,
            plan=plan,
            training=self.training,
            model=self.model,
            script_args=tuple(self.script_args),
            config_arg=self.config_arg,
            steps=self.steps,
            warmup=self.warmup,
            timeout_s=timeout_s,
            workdir=trial_dir,
            optimizer_impl=self.optimizer_impl,
            loss=self.loss,
        )
        progress: list[str] = []

        def seen(line: str) -> None:
            if "zeroplan-progress" in line:
                progress.append(line)
            if on_line is not None:
                on_line(line)

        result = run_probe(request, on_line=seen)
        outcome = outcome_from_result(result, cfg=cfg, wall_s=time.monotonic() - start, progress=progress)
        outcome = replace(outcome, timeout_s=timeout_s, timeout_derived=derived)
        why = None if outcome.ok else outside_plan(outcome.status, outcome.error, outcome.log_tail, waits_s=outcome.waits_s)
        if why is not None:
            # Not the plan's failure: run it once more; what that run says is the plan's answer.
            if on_line is not None:
                on_line(f"zeroplan: trial {trial_number} failed for a reason outside its plan ({why}); running it once more")
            progress.clear()
            again = time.monotonic()
            result = run_probe(request, on_line=seen)
            outcome = outcome_from_result(result, cfg=cfg, wall_s=time.monotonic() - again, progress=progress)
            outcome = replace(outcome, timeout_s=timeout_s, timeout_derived=derived, retried=why)
        self._remember(plan, outcome)
        return outcome

    def _remember(self, plan: Plan, outcome: ProbeOutcome) -> None:
        from zeroplan.tuner.probetime import ProbeTiming

        predicted = self.predicted_step_time(plan) if self.predicted_step_time else None
        if not (outcome.ok and predicted and outcome.step_time_s > 0):
            return
        accum = plan.gradient_accumulation_steps
        steps = outcome.optimizer_steps or (self.warmup + self.steps)
        if outcome.micro_steps:
            # It stopped at a boundary: warm-up plus the measured micro-steps, in optimizer steps.
            steps = max(steps, outcome.micro_steps / accum)
        self.history.append(
            ProbeTiming(predicted_step_time_s=predicted, step_time_s=outcome.step_time_s, wall_s=outcome.plan_wall_s, optimizer_steps=steps,
                        startup_s=outcome.startup_s, startup_class=plan.zero_label)
        )


def launch_request(*, script: Path, nproc: int, backend: str = "deepspeed", torchrun_args: tuple[str, ...] = (), env: Optional[dict] = None,
                   nodes: Any = None, launcher: str = "warm", target_ci: Optional[float] = None, **fields) -> Any:
    """The ``zeroplan.runtime.ProbeRequest`` of a tune's probe: how its ranks start (script, ranks,
    engine, launcher, nodes, environment, the stop rule's target) and ``fields``."""
    from zeroplan.runtime import ProbeRequest

    items = tuple((env or {}).items()) + ((("ZEROPLAN_PROBE_TARGET_CI", repr(target_ci)),) if target_ci else ())
    return ProbeRequest(script=script, nproc=nproc, backend=backend, torchrun_args=torchrun_args, env=items, nodes=nodes, launcher=launcher,
                        **fields)


def begin_warm_server(request: Any, *, workdir: Path, ready_timeout_s: float) -> Callable[[], Optional[float]]:
    """Start the warm launcher's server for probes launched as ``request`` (:func:`launch_request`)
    now, without waiting (one node, launcher warm), so its imports overlap the caller's work; a
    later call for the same probes finds it running. Returns ``ready()``: it waits for those
    imports, asks the server to load the rest of what ranks need
    (:mod:`zeroplan.runtime.launch.warm_server` ``later_work``) — call it when nothing of yours runs
    that this would disturb — and returns the seconds the start took (torch and DeepSpeed imported:
    a measured lower bound on a probe's start-up here); None where probes use torchrun or the
    server cannot start (the first probe then says why)."""
    from zeroplan.runtime import probe_environment, uses_warm_launcher
    from zeroplan.runtime.launch.warm import WarmUnavailable, begin

    if not uses_warm_launcher(request):
        return lambda: None
    server = begin(probe_environment(request), log_path=workdir / "warm-server.log", ready_timeout_s=ready_timeout_s)

    def ready() -> Optional[float]:
        try:
            seconds = server.wait_ready()
        except WarmUnavailable:
            return None
        server.preload_rest()
        return seconds

    return ready


def outcome_from_result(result: Any, *, cfg: dict, wall_s: float, progress: Optional[list[str]] = None) -> ProbeOutcome:
    """Convert the runtime's ProbeResult into a ProbeOutcome (missing numbers become 0).

    ``progress``: the worker's progress lines (``zeroplan.runtime.rank.worker.PROGRESS_PREFIX``); None
    when they were not collected, so the failure phase stays unknown.
    """
    from zeroplan.tuner.failures import measurement_from_lines, progress_from_lines

    ready_s, steps, _ = progress_from_lines(progress or [])
    measured = measurement_from_lines(progress or [])
    per_rank = tuple(int(x or 0) for x in (getattr(result, "peak_memory_per_rank", None) or ()))
    error = getattr(result, "error", None) or ""
    return ProbeOutcome(
        status=str(result.status),
        samples_per_second=float(getattr(result, "samples_per_second", 0.0) or 0.0),
        tokens_per_second=float(getattr(result, "tokens_per_second", 0.0) or 0.0),
        step_time_s=float(getattr(result, "step_time", 0.0) or 0.0),
        peak_memory_bytes=int(getattr(result, "peak_memory", 0) or 0),
        peak_memory_per_rank_bytes=per_rank,
        error=str(error).strip().splitlines()[-1] if str(error).strip() else "",
        log_tail=str(getattr(result, "log_tail", "") or ""),
        host_peak_per_node_bytes=int(getattr(result, "host_peak_per_node", 0) or 0),
        host_peak_per_rank_bytes=tuple(int(x or 0) for x in (getattr(result, "host_peak_per_rank", None) or ())),
        estimated_host_peak_per_node_bytes=int(getattr(result, "estimated_host_peak_per_node", 0) or 0),
        memory_limit=str(getattr(result, "memory_limit", "") or ""),
        wall_s=wall_s,
        ds_config=cfg,
        trl=dict(getattr(result, "trl", None) or {}),
        engine_ready=None if progress is None else ready_s is not None,
        optimizer_steps=steps,
        startup_s=ready_s,
        step_time_ci_s=measured[1] if measured else None,
        micro_steps=measured[2] if measured else 0,
        launcher=str(getattr(result, "launcher", "") or ""),
        phases_s=dict(getattr(result, "phases_s", None) or {}),
        waits_s=dict(getattr(result, "waits_s", None) or {}),
        cpu_step_time_s=getattr(result, "cpu_step_time", None),
        load_average=tuple(getattr(result, "load_average", None) or ()) or None,
    )
