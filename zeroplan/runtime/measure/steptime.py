"""The optimizer-step time of a probe from timed micro-steps, with its 95% confidence interval.

With gradient accumulation G an optimizer step is G micro-steps: G − 1 that only run forward and
backward (time m each) and one at the accumulation boundary that also reduces gradients and runs
the optimizer (time b). So

    T = (G − 1)·m + b,

estimated by T̂ = (G − 1)·m̄ + b̄ from n_m timed non-boundary micro-steps and n_b boundary ones,
with Var(T̂) = (G − 1)²·s_m²/n_m + s_b²/n_b (independent samples). A probe can therefore stop
after one measured optimizer step when G is large, instead of timing several whole steps.
With one boundary sample s_b is unknown; it is taken as s_m·b̄/m̄ (the same coefficient of
variation). The half-width is t(0.975, df)·√Var with Welch–Satterthwaite degrees of freedom
(Welch 1947; the Student t quantiles are from the NIST/SEMATECH e-Handbook, table 1.3.6.7.2).
Stdlib only.

Which number a probe reports (:class:`MeasurePolicy`) was chosen on recorded series of the same plans
probed again and again (``benchmarks/bench_repeat_measure.py``, ``benchmarks/results/repeat_measure.txt``):
the statistic over the timed steps, how many steps at least and at most, and the stop rule's target.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["MeasurePolicy", "PROBE_POLICY", "STATISTICS", "StepTimeEstimate", "estimate_step_time", "replay", "step_statistic", "t_quantile_975", "whole_steps"]

#: Student t 0.975 quantiles by degrees of freedom (NIST/SEMATECH e-Handbook, table 1.3.6.7.2).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
         21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042,
         40: 2.021, 50: 2.009, 60: 2.000, 80: 1.990, 100: 1.984}


def t_quantile_975(df: int) -> float:
    """Student t 0.975 quantile for ``df`` ≥ 1 degrees of freedom (next smaller table row; 1.960 past 100)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1")
    if df > 100:
        return 1.960
    return _T975[max(k for k in _T975 if k <= df)]


@dataclass(frozen=True)
class StepTimeEstimate:
    """An optimizer-step time estimated from micro-steps."""

    step_time_s: float
    """Estimated seconds per optimizer step, T̂ = (G − 1)·m̄ + b̄."""
    half_width_s: float
    """Half-width of its 95% confidence interval, seconds."""
    micro_steps: int
    """Timed micro-steps it rests on (boundary ones included)."""

    @property
    def relative_half_width(self) -> float:
        return self.half_width_s / self.step_time_s if self.step_time_s > 0 else math.inf


def estimate_step_time(micro_s: Sequence[float], boundary_s: Sequence[float], grad_accum: int, statistic: str = "mean") -> Optional[StepTimeEstimate]:
    """T̂ and its 95% half-width from non-boundary (``micro_s``) and boundary (``boundary_s``)
    micro-step times; None until there are enough samples for an interval (G = 1: 2 boundary
    samples; G > 1: 2 non-boundary and 1 boundary).

    ``statistic`` (:data:`STATISTICS`) other than the mean is taken of the whole optimizer steps
    (each the sum of its G micro-steps, :func:`whole_steps`), never of each kind of micro-step: a
    short micro-step catches a quiet moment of the machine more often than a whole step, so
    (G − 1)·min(m) + min(b) would favour accumulation plans on a loaded machine (the recorded
    series of ``benchmarks/bench_repeat_measure.py`` showed it). The half-width is always the
    mean's: it gauges the spread the stop rule waits on."""
    if grad_accum < 1:
        raise ValueError(f"grad_accum={grad_accum} must be >= 1")
    n_m, n_b = len(micro_s), len(boundary_s)
    if n_b < 1 or (grad_accum == 1 and n_b < 2) or (grad_accum > 1 and n_m < 2):
        return None
    b = statistics.fmean(boundary_s)
    if grad_accum == 1:
        var = statistics.variance(boundary_s) / n_b
        df = n_b - 1
        t = b
    else:
        m = statistics.fmean(micro_s)
        s_m2 = statistics.variance(micro_s)
        s_b2 = statistics.variance(boundary_s) if n_b >= 2 else s_m2 * (b / m) ** 2 if m > 0 else s_m2
        part_m = (grad_accum - 1) ** 2 * s_m2 / n_m
        part_b = s_b2 / n_b
        var = part_m + part_b
        # Welch–Satterthwaite degrees of freedom; with one boundary sample both terms rest on s_m,
        # so the variance has the micro-steps' n_m − 1.
        if n_b >= 2 and part_m + part_b > 0:
            df = max(1, math.floor(var**2 / (part_m**2 / (n_m - 1) + part_b**2 / (n_b - 1))))
        else:
            df = n_m - 1
        t = (grad_accum - 1) * m + b
    if statistic != "mean":
        t = step_statistic(whole_steps(micro_s, boundary_s, grad_accum), statistic)
    return StepTimeEstimate(step_time_s=t, half_width_s=t_quantile_975(df) * math.sqrt(var), micro_steps=n_m + n_b)


#: Statistics a probe can take of its timed steps: the mean; the median; the 20 % trimmed mean
#: (the fifth of the samples at each end dropped); the 25th percentile (linear interpolation);
#: the minimum. Interference from other work only adds time to a step, so the low ones read the
#: plan more than the machine.
STATISTICS = ("mean", "median", "trimmed", "p25", "min")


def whole_steps(micro_s: Sequence[float], boundary_s: Sequence[float], grad_accum: int) -> list[float]:
    """Each measured optimizer step's time: its G − 1 non-boundary micro-steps (in order) plus its boundary one."""
    per = grad_accum - 1
    return [sum(micro_s[i * per : (i + 1) * per]) + b for i, b in enumerate(boundary_s) if len(micro_s) >= (i + 1) * per]


def step_statistic(values: Sequence[float], statistic: str) -> float:
    """One of :data:`STATISTICS` of ``values`` (at least one)."""
    if not values:
        raise ValueError("no values")
    xs = sorted(values)
    if statistic == "mean":
        return statistics.fmean(xs)
    if statistic == "median":
        return statistics.median(xs)
    if statistic == "trimmed":
        k = int(0.2 * len(xs))
        return statistics.fmean(xs[k : len(xs) - k])
    if statistic == "p25":
        pos = 0.25 * (len(xs) - 1)
        lo = math.floor(pos)
        return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (pos - lo)
    if statistic == "min":
        return xs[0]
    raise ValueError(f"statistic {statistic!r} is not one of {', '.join(STATISTICS)}")


@dataclass(frozen=True)
class MeasurePolicy:
    """How a probe measures in micro-step mode: the statistic it reports, when it may stop, when it
    must. ``target_ci`` is the relative 95% half-width at which it stops, but not before
    ``min_steps`` measured optimizer steps; it stops after ``max_steps`` whatever the interval;
    ``extra_warmup`` optimizer steps after the warm-up are run but not timed."""

    statistic: str = "mean"
    target_ci: float = 0.1
    min_steps: int = 1
    max_steps: int = 5
    extra_warmup: int = 0

    def __post_init__(self) -> None:
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic {self.statistic!r} is not one of {', '.join(STATISTICS)}")
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"min_steps={self.min_steps}, max_steps={self.max_steps}: need 1 <= min_steps <= max_steps")

    def label(self) -> str:
        return f"{self.statistic} ci={self.target_ci:g} steps {self.min_steps}-{self.max_steps} skip {self.extra_warmup}"

    def done(self, estimate: Optional[StepTimeEstimate], measured_steps: int) -> bool:
        """Whether a probe that has measured ``measured_steps`` optimizer steps stops at this boundary."""
        if measured_steps >= self.max_steps:
            return True
        return measured_steps >= self.min_steps and estimate is not None and estimate.relative_half_width <= self.target_ci


def replay(policy: MeasurePolicy, micro_s: Sequence[float], boundary_s: Sequence[float], grad_accum: int) -> Optional[tuple[float, int]]:
    """What a probe measuring under ``policy`` would have reported from a recorded series (every
    micro-step after the usual warm-up, in order: G − 1 non-boundary then one boundary per
    optimizer step): (step time, optimizer steps it ran after warm-up). None when the series ends
    before the probe would stop."""
    g = grad_accum
    per = g - 1
    skip = policy.extra_warmup
    for k in range(1, len(boundary_s) - skip + 1):
        micro = micro_s[skip * per : (skip + k) * per]
        boundary = boundary_s[skip : skip + k]
        if len(micro) < k * per:
            return None
        estimate = estimate_step_time(micro, boundary, g, policy.statistic)
        if policy.done(estimate, k):
            if estimate is None:  # stopped by max_steps before an interval existed: the statistic alone
                return step_statistic(whole_steps(micro, boundary, g), policy.statistic), skip + k
            return estimate.step_time_s, skip + k
    return None


#: The policy probes measure under (``--ci`` replaces its target, ``--steps`` its most steps; tune's
#: defaults are these): the fastest measured optimizer step, after at least 2 and at most 6, stopping
#: once the 95% interval is within 5%. Chosen with ``benchmarks/bench_repeat_measure.py`` on the first
#: half of recorded probes (``benchmarks/results/repeat_measure.txt``); on the other half two probes
#: of one plan disagreed by a median 8.8% (p90 14.2%) in CPU seconds, against 14.9% (28.3%) for the
#: mean of 1–5 steps stopping at ±10% used before, with the plans' ranking kept.
PROBE_POLICY = MeasurePolicy(statistic="min", target_ci=0.05, min_steps=2, max_steps=6, extra_warmup=0)
