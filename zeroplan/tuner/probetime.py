"""How long a probe should take: the per-probe timeout and the duration the time budget plans with.

A probe's wall time is a fixed part — launching the ranks, importing, building the engine
(``startup_s``, measured by the worker's ``engine-ready`` line), tearing down — plus its optimizer
steps. Both are learned from the probes that worked: the fixed part is the median of
``wall_s − steps × step_time_s`` over the probes of the plan's own *start-up class* (its ZeRO
stage and offloads: the engine build, the op loads and the partitioning differ between them —
ZeRO-3 with CPU offload loads DeepSpeed's ``cpu_adam`` and partitions every parameter, ZeRO-0
does neither), and a plan's step time is its predicted step time times the median
measured/predicted ratio (the estimator's absolute times are for its GPU profile; their ratios
carry over to the machine that runs the probes). A plan whose class no probe has measured yet
gets the first-probe rule, its start-up at least the machine's floor and the slowest start-up
measured so far: never a faster plan's time. ``wall_s`` is the plan's own: waits that are not
its plan's (the warm server, an op build) are left out by the launcher. Pure functions, stdlib only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = [
    "Gap",
    "ProbeTiming",
    "FIRST_TIMEOUT_MARGIN",
    "FIRST_TIMEOUT_SLACK_S",
    "TIMEOUT_MARGIN",
    "TIMEOUT_SLACK_S",
    "first_probe_timeout",
    "expected_probe_s",
    "predicted_gap",
    "probe_floor_s",
    "probe_timeout",
    "probes_in_budget",
    "startup_floor_s",
]

#: A probe may take this many times its expected duration before it is called a hang.
TIMEOUT_MARGIN = 3.0
#: ... plus this many seconds (launch jitter on a loaded machine).
TIMEOUT_SLACK_S = 20.0
#: Before any probe worked, the expected duration is a prediction — its start-up a lower bound
#: (an interpreter importing torch, not DeepSpeed's import and engine build) — so the margin is wider.
FIRST_TIMEOUT_MARGIN = 5.0
#: ... and so is the slack (the engine build, which the floor does not include).
FIRST_TIMEOUT_SLACK_S = 60.0


@dataclass(frozen=True)
class ProbeTiming:
    """What one probe that worked tells about probe durations."""

    predicted_step_time_s: float
    """The estimator's optimizer-step time for its plan, seconds."""
    step_time_s: float
    """Measured optimizer-step time, seconds."""
    wall_s: float
    """Whole probe, launch to exit, seconds."""
    optimizer_steps: float
    """Optimizer steps it ran, warm-up included (fractional when it stopped mid-accumulation)."""
    startup_s: Optional[float] = None
    """Worker start to engine built, seconds (None: not reported)."""
    startup_class: str = ""
    """The plan's start-up class: its ZeRO stage and offloads (``Plan.zero_label``, e.g. ``z3+opt:cpu``)."""


def _fixed_parts(history: Sequence[ProbeTiming], startup_class: Optional[str] = None) -> list[float]:
    return [max(h.wall_s - h.optimizer_steps * h.step_time_s, 0.0) for h in history if startup_class is None or h.startup_class == startup_class]


def _fixed_s(history: Sequence[ProbeTiming], startup_class: Optional[str] = None) -> Optional[float]:
    """Median fixed part of the probes of ``startup_class`` (None: of all); None when there are none."""
    parts = _fixed_parts(history, startup_class)
    return statistics.median(parts) if parts else None


def _scale(history: Sequence[ProbeTiming]) -> Optional[float]:
    ratios = [h.step_time_s / h.predicted_step_time_s for h in history if h.predicted_step_time_s > 0]
    return statistics.median(ratios) if ratios else None


def expected_probe_s(
    predicted_step_time_s: float, history: Sequence[ProbeTiming], *, optimizer_steps: float, startup_class: Optional[str] = None
) -> Optional[float]:
    """Expected wall time of a probe of ``optimizer_steps`` steps of a plan predicted at
    ``predicted_step_time_s``; None before any probe worked. Its fixed part is that of the probes
    of its ``startup_class``, else (none measured yet) the slowest fixed part measured."""
    scale = _scale(history)
    if not history or scale is None:
        return None
    fixed = _fixed_s(history, startup_class)
    if fixed is None:
        fixed = max(_fixed_parts(history))
    return fixed + optimizer_steps * scale * predicted_step_time_s


def first_probe_timeout(predicted_step_time_s: float, *, startup_s: float, optimizer_steps: float, ceiling_s: float) -> tuple[float, bool]:
    """(timeout seconds, derived?) of a probe before any probe worked: ``FIRST_TIMEOUT_MARGIN`` ×
    (the predicted start-up ``startup_s`` + ``optimizer_steps`` at the estimator's step time) +
    ``FIRST_TIMEOUT_SLACK_S``, never above ``ceiling_s`` (the user's --timeout)."""
    derived = FIRST_TIMEOUT_MARGIN * probe_floor_s(predicted_step_time_s, startup_s=startup_s, optimizer_steps=optimizer_steps) + FIRST_TIMEOUT_SLACK_S
    return (derived, True) if derived < ceiling_s else (ceiling_s, False)


def probe_timeout(
    predicted_step_time_s: float,
    history: Sequence[ProbeTiming],
    *,
    ceiling_s: float,
    optimizer_steps: float,
    startup_s: Optional[float] = None,
    startup_class: Optional[str] = None,
) -> tuple[float, bool]:
    """(timeout seconds, derived?): ``TIMEOUT_MARGIN`` × the expected duration + ``TIMEOUT_SLACK_S``,
    never above ``ceiling_s`` (the user's --timeout). Before any probe of the plan's
    ``startup_class`` worked (None: any class counts): :func:`first_probe_timeout` from its
    start-up — at least the machine's floor ``startup_s`` and the slowest fixed part measured —
    and its steps at the measured/predicted scale, or the ceiling with neither."""
    seen = bool(_fixed_parts(history, startup_class))
    expected = expected_probe_s(predicted_step_time_s, history, optimizer_steps=optimizer_steps, startup_class=startup_class) if seen else None
    if expected is None:
        measured = _fixed_parts(history)
        if startup_s is None and not measured:
            return ceiling_s, False
        startup = max([startup_s or 0.0, *measured])
        scale = _scale(history) or 1.0
        return first_probe_timeout(predicted_step_time_s * max(scale, 1.0), startup_s=startup, optimizer_steps=optimizer_steps, ceiling_s=ceiling_s)
    derived = TIMEOUT_MARGIN * expected + TIMEOUT_SLACK_S
    return (derived, True) if derived < ceiling_s else (ceiling_s, False)


def startup_floor_s(*, python: Optional[str] = None) -> float:
    """Seconds a fresh interpreter here takes to import torch: every probe rank pays at least this
    before its engine exists (a lower bound on a probe's start-up, measured in a subprocess)."""
    import subprocess
    import sys
    import time

    start = time.monotonic()
    subprocess.run([python or sys.executable, "-c", "import torch"], check=False, capture_output=True, timeout=600)
    return time.monotonic() - start


def probe_floor_s(predicted_step_time_s: float, *, startup_s: float, optimizer_steps: float) -> float:
    """A lower bound on one probe's wall time: start-up plus its steps at the predicted step time."""
    return startup_s + optimizer_steps * predicted_step_time_s


@dataclass(frozen=True)
class Gap:
    """How much faster the best plan not probed is predicted to be than the best one measured."""

    fraction: float
    """(predicted throughput of the best unprobed plan, scaled by measured/predicted) / best measured − 1; ≤ 0: none predicted faster."""
    plan_key: Optional[str]
    """That plan (None when every admissible plan was probed)."""
    unprobed: int
    """Admissible plans not probed."""


def predicted_gap(best_measured: float, probed: Sequence[tuple[float, float]], unprobed: Sequence[tuple[str, float]]) -> Gap:
    """The :class:`Gap` from ``probed`` (predicted, measured samples/s of probes that worked) and
    ``unprobed`` (plan key, predicted samples/s of plans still admissible).

    Predictions are scaled by the median measured/predicted ratio of the probes, so a time model
    that is off by a constant factor (a datasheet for another machine) still compares fairly.
    """
    if not unprobed:
        return Gap(fraction=0.0, plan_key=None, unprobed=0)
    ratios = [m / p for p, m in probed if p > 0 and m > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    key, predicted = max(unprobed, key=lambda kv: kv[1])
    return Gap(fraction=predicted * scale / best_measured - 1.0 if best_measured > 0 else float("inf"), plan_key=key, unprobed=len(unprobed))


def probes_in_budget(time_budget_s: float, floor_s: float) -> int:
    """How many probes of at least ``floor_s`` seconds fit in ``time_budget_s``; SpecError (a usage
    error, exit 2) naming how long one takes when not even one fits."""
    from zeroplan.spec import SpecError

    if time_budget_s < floor_s:
        raise SpecError(
            f"--time-budget {time_budget_s:g} s is too small for one probe: one takes at least {floor_s:.0f} s here "
            f"(start-up and its warm-up and measured steps); give --time-budget {max(floor_s * 3, floor_s + 30):.0f} or more"
        )
    return int(time_budget_s // floor_s)
