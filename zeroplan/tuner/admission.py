"""Admission: may a proposed plan be probed, and if not, how is the refusal recorded?

Pure functions of the candidate and what the study already knows (no storage, no Optuna): the
search loop asks :func:`admit` and, for a :class:`Rejection`, writes it into the trial as is.
Rules, in order:

1. the proposal is not a plan the estimator enumerates → PRUNED (``memory`` constraint 1.0);
2. the estimator says it does not fit → PRUNED with the estimator's reason and a ``memory``
   constraint equal to the predicted overshoot (so TPE learns where the infeasible region is);
3. a plan needing no more memory already ran out of memory, or a plan at the same stage and
   offload predicted to need at least the host RAM per node of one that ran out of host memory →
   PRUNED (``oom`` constraint). An OOM never prunes another stage or offload: plans that need
   less are probed next;
4. a hang at a micro-batch no larger at the same stage/offload, or a region two failures with one
   signature rule out (:mod:`zeroplan.tuner.failures`) → PRUNED (``failure`` constraint);
5. another trial holds a claim on the plan → FAIL ``duplicate`` (ignored by TPE);
6. the plan shares a factor with a single failure while plans sharing none are left → FAIL
   ``deferred`` (not claimed: it may be proposed again once those are probed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from zeroplan.tuner.objective import PROBED_STATUSES
from zeroplan.tuner.failures import FAILURE_KINDS, Failure, Region, hang_rule, learned_regions, suspect_rank
from zeroplan.tuner.hostrule import host_oom_rule
from zeroplan.tuner.space import Candidate, SearchSpace, needs_at_least, zero_choice

__all__ = ["Knowledge", "Rejection", "admit", "duplicate", "knowledge_from_trials", "memory_overshoot", "not_enumerated", "oom_rule"]


@dataclass(frozen=True)
class Rejection:
    """Why a proposed plan is not probed, as recorded in its trial."""

    state: str
    """Optuna state the trial ends in: ``PRUNED`` (an infeasible plan, TPE learns from it) or
    ``FAIL`` (a duplicate proposal, TPE ignores it)."""
    status: str
    """zeroplan status: ``pruned`` | ``duplicate`` | ``deferred``."""
    reason: str
    """One line for trials.csv and the report."""
    constraint: Optional[tuple[str, float]] = None
    """Optuna constraint (name, value > 0 means violated) to set, if any."""
    with_prediction: bool = True
    """Record the candidate's predictions with it (False: only the plan key and source)."""


def memory_overshoot(cand: Candidate, gpu_memory_bytes: int, cpu_memory_bytes: int = 0) -> float:
    """The plan's GPU figure (``gpu.required``, the verdict's) over the GPU's memory — or host RAM per node over
    the node's, whichever is larger (``cpu_memory_bytes`` 0: not checked) — as a fraction (at least
    0.01 so it reads as violated)."""
    over = cand.predicted_gpu_bytes / gpu_memory_bytes - 1.0
    if cpu_memory_bytes > 0:
        over = max(over, cand.predicted_host_bytes_per_node / cpu_memory_bytes - 1.0)
    return max(over, 0.01)


def oom_rule(cand: Candidate, ooms: Sequence[tuple[int, Candidate]]) -> Optional[str]:
    """Reason to skip ``cand`` because a plan needing no more memory already OOM'd.

    ``ooms`` holds (trial number, candidate) of every probe that ran out of memory. A plan at the
    same stage/offload with a micro-batch at least as large and no more checkpointing needs at
    least as much activation memory, so it would run out too.
    """
    for number, bad in ooms:
        if bad.key == cand.key:
            continue
        if needs_at_least(cand.plan, bad.plan):
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


@dataclass(frozen=True)
class Knowledge:
    """What the study's finished probes teach admission."""

    ooms: tuple[tuple[int, Candidate], ...] = ()
    """(trial number, plan) of every probe that ran out of memory."""
    host_ooms: tuple[tuple[int, Candidate], ...] = ()
    """(trial number, plan) of the probes among ``ooms`` that ran out of host memory (``memory_limit``)."""
    failures: tuple[tuple[int, Candidate, Failure], ...] = ()
    """(trial number, plan, classified failure) of every failed probe."""
    successes: tuple[Candidate, ...] = ()
    """Plans whose probe worked."""

    @property
    def regions(self) -> list[Region]:
        return learned_regions(self.failures, self.successes)


def knowledge_from_trials(trials: Sequence[Any], space: SearchSpace) -> Knowledge:
    """Read :class:`Knowledge` from the study's trials (their ``status``, ``plan_key`` and
    ``failure_*`` user attrs; plans no longer in ``space`` are ignored)."""
    ooms, host_ooms, failures, successes = [], [], [], []
    for t in trials:
        attrs = t.user_attrs
        status = attrs.get("status")
        cand = space.get(attrs.get("plan_key", "")) if status in PROBED_STATUSES else None
        if cand is None:
            continue
        if status == "ok":
            successes.append(cand)
            continue
        if status == "oom":
            ooms.append((t.number, cand))
            if attrs.get("memory_limit") == "host":
                host_ooms.append((t.number, cand))
        if attrs.get("failure_kind") in FAILURE_KINDS:
            failure = Failure(kind=attrs["failure_kind"], phase=attrs.get("failure_phase") or None, signature=str(attrs.get("signature", "")))
            failures.append((t.number, cand, failure))
    return Knowledge(ooms=tuple(ooms), host_ooms=tuple(host_ooms), failures=tuple(failures), successes=tuple(successes))


def admit(
    cand: Candidate,
    *,
    gpu_memory_bytes: int,
    cpu_memory_bytes: int = 0,
    ooms: Sequence[tuple[int, Candidate]] = (),
    holder: Optional[int] = None,
    knowledge: Optional[Knowledge] = None,
    regions: Optional[Sequence[Region]] = None,
    unsuspected_left: bool = False,
    margin_left: bool = False,
) -> Optional[Rejection]:
    """None if ``cand`` may be probed, else the :class:`Rejection` to record.

    ``cpu_memory_bytes``: the node's host RAM (0: unknown), for the overshoot of a plan pruned on it.
    ``holder`` is the number of a trial that already holds a claim on the plan (None: nobody).
    ``knowledge``: the study's failed and working probes (its OOMs are added to ``ooms``);
    ``regions``: the regions it teaches, when the caller computed them already;
    ``unsuspected_left``: some plan left shares no factor with a failure, so a suspect one waits.
    ``margin_left``: some plan left fits with the verdict's margin, so a tight one waits
    (zeroplan.estimator.verdict: tight plans are probed only after those).
    """
    if not cand.fits:
        overshoot = memory_overshoot(cand, gpu_memory_bytes, cpu_memory_bytes)
        return Rejection(state="PRUNED", status="pruned", reason=cand.reason, constraint=("memory", overshoot))
    knowledge = knowledge or Knowledge()
    reason = oom_rule(cand, tuple(ooms) + knowledge.ooms)
    if reason is None:
        # Only at the same stage and offload: what the estimator predicts across stages is only as
        # right as its host model, and a single OOM must never prune the whole space.
        host_ooms = [(n, bad.plan.label, bad.predicted_host_bytes_per_node) for n, bad in knowledge.host_ooms
                     if bad.key != cand.key and zero_choice(bad.plan) == zero_choice(cand.plan)]
        reason = host_oom_rule(cand.predicted_host_bytes_per_node, host_ooms)
    if reason is not None:
        return Rejection(state="PRUNED", status="pruned", reason=reason, constraint=("oom", 1.0))
    reason = hang_rule(cand, knowledge.failures)
    if reason is not None:
        return Rejection(state="PRUNED", status="pruned", reason=reason, constraint=("failure", 1.0))
    for region in regions if regions is not None else knowledge.regions:
        if region.contains(cand):
            return Rejection(state="PRUNED", status="pruned", reason=region.reason, constraint=("failure", 1.0))
    if holder is not None:
        return duplicate(f"plan already claimed by trial #{holder}")
    if margin_left and cand.verdict == "tight":
        return Rejection(
            state="FAIL",
            status="deferred",
            reason="tight (within the verdict's margin of the GPU's or the node's memory); plans that fit with margin go first",
            with_prediction=False,
        )
    if unsuspected_left and suspect_rank(cand, knowledge.failures) > 0:
        return Rejection(
            state="FAIL",
            status="deferred",
            reason="shares a factor with a failed probe; plans that share none go first",
            with_prediction=False,
        )
    return None
