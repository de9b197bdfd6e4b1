"""How long a probe should take: the per-probe timeout and the duration the time budget plans with.

A probe's wall time is a fixed part — launching the ranks, importing, building the engine
(``startup_s``, measured by the worker's ``engine-ready`` line), tearing down — plus its optimizer
steps. Both are learned from the probes that worked: the fixed part is the median of
``wall_s − steps × step_time_s``, and a plan's step time is its predicted step time times the
median measured/predicted ratio (the estimator's absolute times are for its GPU profile; their
ratios carry over to the machine that runs the probes). Pure functions, stdlib only.
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


def _fixed_s(history: Sequence[ProbeTiming]) -> float:
    return statistics.median(max(h.wall_s - h.optimizer_steps * h.step_time_s, 0.0) for h in history)


def _scale(history: Sequence[ProbeTiming]) -> Optional[float]:
    ratios = [h.step_time_s / h.predicted_step_time_s for h in history if h.predicted_step_time_s > 0]
    return statistics.median(ratios) if ratios else None


def expected_probe_s(predicted_step_time_s: float, history: Sequence[ProbeTiming], *, optimizer_steps: float) -> Optional[float]:
    """Expected wall time of a probe of ``optimizer_steps`` steps of a plan predicted at
    ``predicted_step_time_s``; None before any probe worked."""
    scale = _scale(history)
    if not history or scale is None:
        return None
    return _fixed_s(history) + optimizer_steps * scale * predicted_step_time_s


def first_probe_timeout(predicted_step_time_s: float, *, startup_s: float, optimizer_steps: float, ceiling_s: float) -> tuple[float, bool]:
    """(timeout seconds, derived?) of a probe before any probe worked: ``FIRST_TIMEOUT_MARGIN`` ×
    (the predicted start-up ``startup_s`` + ``optimizer_steps`` at the estimator's step time) +
    ``FIRST_TIMEOUT_SLACK_S``, never above ``ceiling_s`` (the user's --timeout)."""
    derived = FIRST_TIMEOUT_MARGIN * probe_floor_s(predicted_step_time_s, startup_s=startup_s, optimizer_steps=optimizer_steps) + FIRST_TIMEOUT_SLACK_S
    return (derived, True) if derived < ceiling_s else (ceiling_s, False)


def probe_timeout(
    predicted_step_time_s: float, history: Sequence[ProbeTiming], *, ceiling_s: float, optimizer_steps: float, startup_s: Optional[float] = None
) -> tuple[float, bool]:
    """(timeout seconds, derived?): ``TIMEOUT_MARGIN`` × the expected duration + ``TIMEOUT_SLACK_S``,
    never above ``ceiling_s`` (the user's --timeout). Before any probe worked:
    :func:`first_probe_timeout` from the predicted start-up ``startup_s``, or the ceiling without one."""
    expected = expected_probe_s(predicted_step_time_s, history, optimizer_steps=optimizer_steps)
    if expected is None:
        if startup_s is not None:
            return first_probe_timeout(predicted_step_time_s, startup_s=startup_s, optimizer_steps=optimizer_steps, ceiling_s=ceiling_s)
        return ceiling_s, False
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
