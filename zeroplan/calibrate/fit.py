"""Latency–bandwidth fit of collective timings (pure functions, no torch)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

__all__ = ["CollectiveFit", "ring_bytes", "fit_latency_bandwidth", "fixed_and_per_sample"]

#: Ring steps per call relative to an all-gather: all-reduce = reduce-scatter + all-gather.
RING_FACTOR = {"all_gather": 1, "reduce_scatter": 1, "all_reduce": 2}


def ring_bytes(collective: str, size_bytes: int, world_size: int) -> float:
    """Bytes each rank sends in one ring collective of a ``size_bytes`` buffer.

    nccl-tests PERFORMANCE.md: all-gather and reduce-scatter move S·(n−1)/n per rank, all-reduce
    twice that ("bus bandwidth" = these bytes / time).
    """
    return RING_FACTOR[collective] * size_bytes * (world_size - 1) / world_size


@dataclass(frozen=True)
class CollectiveFit:
    """t(S) = k·α·(n−1) + ring_bytes(S)/B for one or several collectives."""

    latency_s: float
    """α: seconds per ring step of one call (the estimator's ``collective_latency_s``)."""
    bandwidth: float
    """B: bus bandwidth in bytes/s (the estimator's ``intra_node_bandwidth`` on one node)."""
    points: int
    """Timings the fit used."""
    max_relative_residual: float
    """Largest |fit − measured| / measured over the points."""


def fit_latency_bandwidth(samples: list[tuple[str, int, float]], world_size: int) -> CollectiveFit:
    """Least-squares fit of α and B to ``(collective, size_bytes, seconds)`` samples.

    Model (nccl-tests PERFORMANCE.md, the same the estimator's ``ring_time`` uses): a call of
    collective c with k = RING_FACTOR[c] takes k·α·(n−1) + ring_bytes(c, S, n)/B. Both terms are
    linear in the unknowns (α, 1/B), fitted with weights 1/t so small and large messages count
    alike (relative error). α is clamped at 0 (a negative intercept means latency is below
    what the sizes can resolve).
    """
    if world_size < 2:
        raise ValueError("a collective fit needs at least 2 processes")
    if len(samples) < 2:
        raise ValueError("a collective fit needs at least 2 timings")
    rows = []
    for collective, size, seconds in samples:
        k = RING_FACTOR[collective]
        rows.append((k * (world_size - 1), ring_bytes(collective, size, world_size), seconds))
    # Weighted normal equations for t = a·x1 + c·x2 with weights w = 1/t².
    s11 = s12 = s22 = r1 = r2 = 0.0
    for x1, x2, t in rows:
        w = 1.0 / (t * t)
        s11 += w * x1 * x1
        s12 += w * x1 * x2
        s22 += w * x2 * x2
        r1 += w * x1 * t
        r2 += w * x2 * t
    det = s11 * s22 - s12 * s12
    alpha, inv_b = ((s22 * r1 - s12 * r2) / det, (s11 * r2 - s12 * r1) / det) if det > 0 else (0.0, 0.0)
    if alpha < 0 or inv_b <= 0:
        alpha = max(alpha, 0.0)
        # Refit the slope alone through the clamped intercept.
        num = sum((x2 / (t * t)) * (t - alpha * x1) for x1, x2, t in rows)
        den = sum(x2 * x2 / (t * t) for _, x2, t in rows)
        inv_b = max(num / den, 1e-18)
    residual = max(abs(alpha * x1 + inv_b * x2 - t) / t for x1, x2, t in rows)
    return CollectiveFit(latency_s=alpha, bandwidth=1.0 / inv_b, points=len(rows), max_relative_residual=residual)


def fixed_and_per_sample(times: dict[int, list[float]]) -> tuple[float, float]:
    """(fixed seconds per step, seconds per sample) through the medians at two micro-batches.

    A training step at micro-batch m takes t(m) = fixed + m · per_sample: compute grows with the
    samples, while the engine's bookkeeping, collectives and optimizer step do not. With the
    medians t_lo, t_hi at micro-batches lo < hi: per_sample = (t_hi − t_lo)/(hi − lo) and
    fixed = t_lo − lo · per_sample (the intercept at m = 0). Medians, not means: one step
    disturbed by another job on a shared machine moves a mean but not a median.
    """
    if len(times) != 2:
        raise ValueError(f"need step times at exactly two micro-batches, got {sorted(times)}")
    lo, hi = sorted(times)
    if lo == hi or lo < 1:
        raise ValueError(f"micro-batches must be two different sizes >= 1, got {lo} and {hi}")
    if not times[lo] or not times[hi]:
        raise ValueError("need at least one step time at each micro-batch")
    t_lo, t_hi = statistics.median(times[lo]), statistics.median(times[hi])
    per_sample = (t_hi - t_lo) / (hi - lo)
    return t_lo - lo * per_sample, per_sample
