"""Admission: may a proposed plan be probed, and if not, how is the refusal recorded?

Pure functions of the candidate and what the study already knows (no storage, no Optuna): the
search loop asks :func:`admit` and, for a :class:`Rejection`, writes it into the trial as is.
Rules, in order:

1. the proposal is not a plan the estimator enumerates → PRUNED (``memory`` constraint 1.0);
2. the estimator says it does not fit → PRUNED with the estimator's reason and a ``memory``
   constraint equal to the predicted overshoot (so TPE learns where the infeasible region is);
3. a plan needing no more memory already ran out of memory → PRUNED (``oom`` constraint);
4. another trial holds a claim on the plan → FAIL ``duplicate`` (ignored by TPE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from zeroplan.tuner.space import CHECKPOINTING_MEMORY_RANK, Candidate, zero_choice

__all__ = ["Rejection", "admit", "duplicate", "memory_overshoot", "not_enumerated", "oom_rule"]


@dataclass(frozen=True)
class Rejection:
    """Why a proposed plan is not probed, as recorded in its trial."""

    state: str
    """Optuna state the trial ends in: ``PRUNED`` (an infeasible plan, TPE learns from it) or
    ``FAIL`` (a duplicate proposal, TPE ignores it)."""
    status: str
    """zeroplan status: ``pruned`` | ``duplicate``."""
    reason: str
    """One line for trials.csv and the report."""
    constraint: Optional[tuple[str, float]] = None
    """Optuna constraint (name, value > 0 means violated) to set, if any."""
    with_prediction: bool = True
    """Record the candidate's predictions with it (False: only the plan key and source)."""


def memory_overshoot(cand: Candidate, gpu_memory_bytes: int) -> float:
    """Predicted peak memory over the GPU's, as a fraction (at least 0.01 so it reads as violated)."""
    return max(cand.predicted_peak_memory_bytes / gpu_memory_bytes - 1.0, 0.01)


def oom_rule(cand: Candidate, ooms: Sequence[tuple[int, Candidate]]) -> Optional[str]:
    """Reason to skip ``cand`` because a plan needing no more memory already OOM'd.

    ``ooms`` holds (trial number, candidate) of every probe that ran out of memory. A plan at the
    same stage/offload with a micro-batch at least as large and no more checkpointing needs at
    least as much activation memory, so it would run out too.
    """
    for number, bad in ooms:
        if bad.key == cand.key:
            continue
        if (
            zero_choice(bad.plan) == zero_choice(cand.plan)
            and cand.plan.micro_batch >= bad.plan.micro_batch
            and CHECKPOINTING_MEMORY_RANK[cand.plan.checkpointing] <= CHECKPOINTING_MEMORY_RANK[bad.plan.checkpointing]
        ):
            return f"larger than an OOM'd micro-batch (trial #{number}: {bad.plan.label})"
    return None


def not_enumerated() -> Rejection:
    """The sampler proposed a combination the estimator does not enumerate for this model and batch."""
    return Rejection(
        state="PRUNED",
        status="pruned",
        reason="not a plan the estimator enumerates for this model and batch",
        constraint=("memory", 1.0),
        with_prediction=False,
    )


def duplicate(reason: str) -> Rejection:
    """Another trial owns the plan (or the last probe slot)."""
    return Rejection(state="FAIL", status="duplicate", reason=reason, with_prediction=False)


def admit(
    cand: Candidate,
    *,
    gpu_memory_bytes: int,
    ooms: Sequence[tuple[int, Candidate]],
    holder: Optional[int],
) -> Optional[Rejection]:
    """None if ``cand`` may be probed, else the :class:`Rejection` to record.

    ``holder`` is the number of a trial that already holds a claim on the plan (None: nobody).
    """
    if not cand.fits:
        return Rejection(state="PRUNED", status="pruned", reason=cand.reason, constraint=("memory", memory_overshoot(cand, gpu_memory_bytes)))
    reason = oom_rule(cand, ooms)
    if reason is not None:
        return Rejection(state="PRUNED", status="pruned", reason=reason, constraint=("oom", 1.0))
    if holder is not None:
        return duplicate(f"plan already claimed by trial #{holder}")
    return None
