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
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["StepTimeEstimate", "estimate_step_time", "t_quantile_975"]

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


def estimate_step_time(micro_s: Sequence[float], boundary_s: Sequence[float], grad_accum: int) -> Optional[StepTimeEstimate]:
    """T̂ and its 95% half-width from non-boundary (``micro_s``) and boundary (``boundary_s``)
    micro-step times; None until there are enough samples for an interval (G = 1: 2 boundary
    samples; G > 1: 2 non-boundary and 1 boundary)."""
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
    return StepTimeEstimate(step_time_s=t, half_width_s=t_quantile_975(df) * math.sqrt(var), micro_steps=n_m + n_b)
