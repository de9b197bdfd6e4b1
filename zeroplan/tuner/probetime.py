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

__all__ = ["ProbeTiming", "expected_probe_s", "probe_timeout", "TIMEOUT_MARGIN", "TIMEOUT_SLACK_S"]

#: A probe may take this many times its expected duration before it is called a hang.
TIMEOUT_MARGIN = 3.0
#: ... plus this many seconds (launch jitter on a loaded machine).
TIMEOUT_SLACK_S = 20.0


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


def probe_timeout(predicted_step_time_s: float, history: Sequence[ProbeTiming], *, ceiling_s: float, optimizer_steps: float) -> tuple[float, bool]:
    """(timeout seconds, derived?): ``TIMEOUT_MARGIN`` × the expected duration + ``TIMEOUT_SLACK_S``,
    never above ``ceiling_s`` (the user's --timeout); the ceiling itself before any probe worked."""
    expected = expected_probe_s(predicted_step_time_s, history, optimizer_steps=optimizer_steps)
    if expected is None:
        return ceiling_s, False
    derived = TIMEOUT_MARGIN * expected + TIMEOUT_SLACK_S
    return (derived, True) if derived < ceiling_s else (ceiling_s, False)
