"""The search loop: Optuna ask/tell over the plans the estimator says fit, one probe per trial.

Order of trials:

1. plans the estimator rules out are written into the study as PRUNED trials (with the reason and
   a positive ``memory`` constraint, so TPE learns where the infeasible region is) — never probed;
2. the estimator's best predictions are enqueued first (``study.enqueue_trial``), spread over the
   ZeRO stage/offload choices;
3. then the sampler (TPE by default) proposes; a proposal that is already claimed by another trial
   is recorded as FAIL "duplicate" (ignored by TPE) and after a few in a row the best-predicted
   untried plan is enqueued instead, so the search never stalls on a finite space.

The jobs around the loop live in their own modules: the claims ledger over a shared study, with
crash recovery (:mod:`zeroplan.tuner.ledger`: several ``zeroplan tune`` processes on one storage
never probe the same plan twice; ``--resume`` fails the trials of dead workers and enqueues their
plans again), and admission (:mod:`zeroplan.tuner.admission`: pure functions saying whether a
proposed plan may be probed — an OOM prunes larger micro-batches at the same stage/offload), and
the opening (:mod:`zeroplan.tuner.seeding`: the sampler and the estimator's first plans).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Callable, Optional

from zeroplan.tuner.admission import Knowledge, Rejection, admit, duplicate, knowledge_from_trials, memory_overshoot, not_enumerated
from zeroplan.tuner.coreshare import CoreWatch
from zeroplan.tuner.failures import classify_failure, script_wide_failure, suspect_rank
from zeroplan.tuner.ledger import REMEASURED_ATTR, ClaimsLedger, first_line, remeasurements, storage_call
from zeroplan.tuner.objective import PROBED_STATUSES, ProbeOutcome, Runner
from zeroplan.tuner.probetime import Gap, predicted_gap
from zeroplan.tuner.seeding import NEAR_BEST, SAMPLERS, initial_candidates, make_sampler, space_signature
from zeroplan.tuner.settings import Trust, TuneSettings, TuneSummary
from zeroplan.tuner.space import Candidate, SearchSpace
from zeroplan.tuner.storage import StorageError, fail_stale_trials, heartbeat

__all__ = ["NEAR_BEST", "REMEASURED_ATTR", "SAMPLERS", "remeasurements", "Trust", "TuneSettings", "TuneSummary", "Tuner", "initial_candidates", "make_sampler", "space_signature"]

_LOG_TAIL_CHARS = 2000


#: Study attribute set once the study is seeded (pruned plans recorded, the estimator's picks enqueued).
SEEDED_ATTR = "zeroplan_seeded"
#: Longest wait for another worker's seeding of the study before this one seeds it itself.
SEED_WAIT_S = 60.0

#: Two measurements of one top plan further apart than this (max / min − 1) get a third, and the
#: plan is ranked by the median of the three: one reading taken while the machine was slow (on a
#: shared machine a core can run at half speed for seconds, ``benchmarks/turns_same_work.py``)
#: then no longer moves the plan's figure. 10 %: the agreement issue 22 asks of two measurements.
SETTLE = 0.10

#: The error recorded for a probe that ended ``ok`` without a step time.
NO_THROUGHPUT = "the probe ran but measured no step time, so it has no throughput to rank"


def failure_constraint(status: str) -> str:
    """The Optuna constraint a failed probe violates: ``oom`` for out-of-memory (as the OOM rule's
    pruned plans), ``failure`` for every other failure (as the failure-region rule's)."""
    return "oom" if status == "oom" else "failure"


class Tuner:
    """One worker of a tuning study: ``prepare()`` once, then ``run()`` the ask → admit → claim →
    probe → tell loop. Claims and recovery are the :class:`ClaimsLedger`'s, admission is
    :func:`zeroplan.tuner.admission.admit`'s."""

    def __init__(
        self,
        study: Any,
        space: SearchSpace,
        runner: Runner,
        settings: TuneSettings,
        *,
        on_event: Optional[Callable[..., None]] = None,
        after_trial: Optional[Callable[[], None]] = None,
        clock: Callable[[], float] = time.time,
        expected_probe_s: Optional[Callable[[Any], Optional[float]]] = None,
        cores: Optional[CoreWatch] = None,
    ) -> None:
        self.study = study
        self.expected_probe_s = expected_probe_s
        """Expected seconds of a probe of a plan (None: unknown); the time budget starts no probe that would not fit."""
        self.space = space
        self.runner = runner
        self.settings = settings
        self.on_event = on_event or (lambda kind, **data: None)
        self.after_trial = after_trial or (lambda: None)
        self.clock = clock
        self.ledger = ClaimsLedger(study, clock=clock)
        self._load: list[float] = []
        """1-minute load average at the start of each probe of this process."""
        self.worker = self.ledger.worker
        self.cores = cores or CoreWatch()
        """Readings of the cores' reduced-speed time, before the search and after its re-measurements."""

    # ------------------------------------------------------------------ what the study knows

    def probes_in_study(self, trials: Optional[list[Any]] = None) -> int:
        """Probed trials plus live claimed ones (so workers together stop at --trials)."""
        return self.ledger.probes_in_study(trials)

    def knowledge(self, trials: Optional[list[Any]] = None) -> Knowledge:
        """What the study's probes so far teach (OOMs, classified failures, working plans)."""
        return knowledge_from_trials(trials if trials is not None else self.ledger.trials(), self.space)

    def remaining(self, trials: Optional[list[Any]] = None, knowledge: Optional[Knowledge] = None) -> list[Candidate]:
        """Fitting candidates nobody has claimed and admission does not refuse, in the order they
        should go: plans sharing no factor with a failure first, then by prediction."""
        trials = trials if trials is not None else self.ledger.trials()
        knowledge = knowledge or self.knowledge(trials)
        regions = knowledge.regions
        claimed = self.ledger.claimed_keys(trials)
        gpu = self.space.cluster.gpu_memory_bytes
        left = [
            c
            for c in self.space.fitting
            if c.key not in claimed and admit(c, gpu_memory_bytes=gpu, cpu_memory_bytes=self.space.cluster.cpu_memory_per_node_bytes, knowledge=knowledge, regions=regions) is None
        ]
        # Stable: prediction order within; tight plans after those that fit with margin.
        return sorted(left, key=lambda c: (suspect_rank(c, knowledge.failures), c.verdict == "tight"))

    def measurements(self, trial: Any, again: Optional[dict[str, list[float]]] = None) -> list[float]:
        """Every throughput measured for a COMPLETE trial's plan: its probe's, then its re-measurements
        (``again``: the study's, already read by :meth:`ClaimsLedger.remeasurements`; None: read them)."""
        again = self.ledger.remeasurements() if again is None else again
        return [float(trial.value), *(float(v) for v in again.get(trial.user_attrs.get("plan_key", ""), []))]

    def best(self) -> Any:
        """The COMPLETE trial with the highest median measured throughput (its probe and any
        re-measurements), or None."""
        done = [t for t in self.ledger.trials() if t.state.name == "COMPLETE" and t.value is not None]
        again = self.ledger.remeasurements()  # one read of the study for every trial
        return max(done, key=lambda t: statistics.median(self.measurements(t, again))) if done else None

    # ------------------------------------------------------------------ setup

    def prepare(self, *, resume: bool) -> list[str]:
        """Check the study matches this space, recover crashed trials (resume), seed a new study."""
        messages: list[str] = []
        self._check_signature()
        if resume:
            messages.extend(self.ledger.recover())
        if not self.ledger.study_attr(SEEDED_ATTR):
            # Workers starting together on a new study all find it unseeded: one claims the seeding
            # in the storage, the others wait for it (a claimant that died is taken over).
            claimant = self.ledger.claim_once("seeding")
            if claimant is None or not self.ledger.wait_study_attr(SEEDED_ATTR, claimant=claimant, wait_s=SEED_WAIT_S):
                messages.append(self._seed())
            else:
                messages.append(f"study seeded by worker {claimant}")
                self._check_signature()
        return messages

    def _check_signature(self) -> None:
        signature = space_signature(self.space)
        stored = self.ledger.study_attr("space_signature")
        if stored is not None and stored != signature:
            raise StorageError(
                "the study in this storage was made for a different model, batch or search space "
                f"(signature {stored} ≠ {signature}); choose another --output/--storage"
            )

    def _seed(self) -> str:
        """Record the estimator's pruned plans as PRUNED trials and enqueue its best predictions;
        then mark the study seeded (other workers wait for that mark, :meth:`prepare`)."""
        from optuna.trial import TrialState, create_trial

        self.ledger.set_study_attr("space_signature", space_signature(self.space))
        dists = self.space.distributions()
        gpu = self.space.cluster.gpu_memory_bytes
        for cand in self.space.pruned:
            self.ledger.add_trial(
                create_trial(
                    state=TrialState.PRUNED,
                    params=cand.params,
                    distributions=dists,
                    user_attrs=self._candidate_attrs(cand, source="estimator")
                    | {"status": "pruned", "reason": cand.reason, "probed": False},
                    constraints={"memory": memory_overshoot(cand, gpu)},
                )
            )
        initial = initial_candidates(self.space, self.settings.initial)
        for cand in initial:
            self.ledger.enqueue(cand.params, {"source": "estimator"})
        self.ledger.set_study_attr(SEEDED_ATTR, True)
        return (
            f"new study: {len(self.space.candidates)} plans, {len(self.space.pruned)} pruned by the "
            f"estimator, {len(initial)} best predictions enqueued first"
        )

    # ------------------------------------------------------------------ the loop

    def _candidate_attrs(self, cand: Candidate, *, source: str) -> dict[str, Any]:
        return {
            "plan_key": cand.key,
            "plan": cand.plan.as_dict(),
            "source": source,
            "predicted_samples_per_second": cand.predicted_samples_per_second,
            "predicted_peak_memory_bytes": cand.predicted_peak_memory_bytes,
            "predicted_gpu_total_bytes": cand.predicted_gpu_total_bytes,
            "predicted_step_time_s": cand.predicted_step_time_s,
            "predicted_rank": cand.rank,
        }

    def _suggest(self, trial: Any) -> dict[str, Any]:
        params = {
            "zero": trial.suggest_categorical("zero", self.space.zero_choices),
            "checkpointing": trial.suggest_categorical("checkpointing", self.space.checkpointing_choices),
            "micro_batch": trial.suggest_categorical("micro_batch", self.space.micro_batches),
        }
        if self.space.bucket_sizes:
            params["reduce_bucket_size"] = trial.suggest_categorical("reduce_bucket_size", self.space.bucket_sizes)
        if self.space.layout_choices:
            # The layout (--sp/--tp/--ep) is a parameter of the plan like the stage: without it every
            # sampled or enqueued trial maps to data parallelism, which a space of sp/tp/ep > 1 only
            # never enumerated (the loop then rejected every trial for ever).
            params["layout"] = trial.suggest_categorical("layout", self.space.layout_choices)
        return params

    def _propose(self, trial: Any) -> tuple[dict[str, Any], str]:
        """The trial's parameters (sampled or enqueued) and where they came from."""
        from optuna.trial import TrialState

        with storage_call(f"choosing the plan of trial #{trial.number}"):
            try:
                params = self._suggest(trial)
            except ValueError as exc:
                self.study.tell(trial, state=TrialState.FAIL)
                raise StorageError(
                    f"the study's parameters do not match this search space ({first_line(exc)}); "
                    "choose another --output/--storage"
                ) from None
            return params, trial.user_attrs.get("source", "sampler")

    def _reject(self, trial: Any, cand: Optional[Candidate], rejection: Rejection, *, source: str) -> None:
        from optuna.trial import TrialState

        if rejection.with_prediction and cand is not None:
            attrs = self._candidate_attrs(cand, source=source)
        else:
            attrs = {"plan_key": cand.key if cand is not None else "", "source": source}
        self.ledger.set_attrs(trial, attrs | {"status": rejection.status, "reason": rejection.reason, "probed": False})
        if rejection.constraint is not None:
            with storage_call(f"writing trial #{trial.number}"):
                trial.set_constraint(*rejection.constraint)
        self.ledger.tell(trial, state=TrialState[rejection.state])
        self.on_event("skip", number=trial.number, key=attrs["plan_key"], status=rejection.status, reason=rejection.reason)

    def _stop_reason(self, trials: list[Any], start: float, knowledge: Knowledge, remaining: list[Candidate]) -> Optional[str]:
        if self.probes_in_study(trials) >= self.settings.trials:
            return "trials reached"
        budget = self.settings.time_budget_s
        if budget is not None:
            elapsed = time.monotonic() - start
            expected = self.expected_probe_s(remaining[0].plan) if remaining and self.expected_probe_s else None
            if elapsed >= budget or (expected is not None and elapsed + expected > budget):
                return "time budget"
        if self.script_failure(trials, knowledge) is not None:
            return "every plan fails"
        if not remaining and not any(t.state.name == "WAITING" for t in trials):
            # An enqueued pick is released, not left waiting: the loop asks it and admission
            # records why it is not probed (an OOM's rule, a claim), as for any proposal.
            return "space exhausted"
        return None

    def script_failure(self, trials: Optional[list[Any]] = None, knowledge: Optional[Knowledge] = None) -> Optional[tuple[str, str]]:
        """(signature, fix) when no probe worked and one failure region covers every plan not yet probed."""
        trials = trials if trials is not None else self.ledger.trials()
        knowledge = knowledge or self.knowledge(trials)
        claimed = self.ledger.claimed_keys(trials)
        open_plans = [c for c in self.space.fitting if c.key not in claimed]
        return script_wide_failure(knowledge.regions, open_plans, knowledge.successes)

    def run(self) -> TuneSummary:
        """Probe until the study holds ``trials`` probes, the time budget ends or no plan is left."""
        start = time.monotonic()
        self.cores.read("before the search", self.on_event)
        probes_this_run = 0
        rejections = 0
        while True:
            # Another worker may have died mid-trial since the last round: fail its trial and
            # enqueue the retry now (Optuna's heartbeat sweep, then the ledger's own rule).
            with storage_call("failing stale trials"):
                fail_stale_trials(self.study)
            for message in self.ledger.recover():
                self.on_event("recovered", message=message)
            trials = self.ledger.trials()
            knowledge = self.knowledge(trials)
            remaining = self.remaining(trials, knowledge)
            stopped = self._stop_reason(trials, start, knowledge, remaining)
            if stopped is not None:
                break
            if rejections >= self.settings.max_rejections:
                # The sampler keeps proposing taken plans: take the best untried one.
                rejections = 0
                self.ledger.enqueue_first_free([c.params for c in remaining], trials, source="fallback")

            trial = self.ledger.ask()
            params, source = self._propose(trial)
            cand = self.space.candidate_for(params)
            if cand is None:
                rejection: Optional[Rejection] = not_enumerated()
            else:
                rejection = admit(
                    cand,
                    gpu_memory_bytes=self.space.cluster.gpu_memory_bytes,
                    cpu_memory_bytes=self.space.cluster.cpu_memory_per_node_bytes,
                    holder=self.ledger.holder_of(cand.key, trials),
                    knowledge=knowledge,
                    unsuspected_left=bool(remaining) and suspect_rank(remaining[0], knowledge.failures) == 0,
                    margin_left=any(c.verdict == "fits" for c in remaining),
                )
            if rejection is not None:
                rejections += 1
                self._reject(trial, cand, rejection, source=source)
                continue
            assert cand is not None
            # Claim the plan, then look for an earlier claim on it by any worker (the snapshot
            # above may predate another worker's claim).
            deadline_s = self.settings.probe_timeout_s + self.settings.stale_grace_s
            self.ledger.claim(trial, self._candidate_attrs(cand, source=source), deadline_s=deadline_s)
            why_not = self.ledger.confirm(trial, cand.key, trials_limit=self.settings.trials)
            if why_not is not None and why_not.startswith("plan already claimed"):
                rejections += 1
                self._reject(trial, cand, duplicate(why_not), source=source)
                continue
            if why_not is not None:
                # Another worker took the last slot between our check and our claim.
                self._reject(trial, cand, duplicate(why_not), source=source)
                stopped = "trials reached"
                break
            rejections = 0
            probes_this_run += self._probe(trial, cand, source=source)

        trust = None
        if stopped != "time budget" or self.settings.time_budget_s is None:
            trust = self.remeasure()
        best = self.best()
        failure = self.script_failure() if stopped == "every plan fails" else None
        return TuneSummary(
            trust=trust,
            gap=self.gap(best),
            failure_signature=failure[0] if failure else None,
            failure_fix=failure[1] if failure else None,
            probes_in_study=self.probes_in_study(),
            probes_this_run=probes_this_run,
            stopped_because=stopped,
            best_number=best.number if best else None,
            best_value=statistics.median(self.measurements(best)) if best else None,
            best_plan_key=best.user_attrs.get("plan_key") if best else None,
            wall_s=time.monotonic() - start,
        )

    def remeasure(self) -> Optional[Trust]:
        """Probe the ``remeasure_top`` best plans once more (in reverse order, so a change of load
        does not favour the first), and a third time each whose two readings differ by more than
        :data:`SETTLE`, before the best is named; record the measurements in the study and say how
        far the ranking holds. None when fewer than one plan worked."""
        done = sorted((t for t in self.ledger.trials() if t.state.name == "COMPLETE" and t.value is not None), key=lambda t: -t.value)
        if not done:
            return None
        top = done[: self.settings.remeasure_top]
        if len(top) >= 2:
            for t in reversed(top):
                self._measure_again(t)
            again = self.ledger.remeasurements()
            for t in reversed(top):  # two readings that disagree: a third settles the plan's median
                values = self.measurements(t, again)
                if len(values) == 2 and max(values) / min(values) - 1 > SETTLE:
                    self._measure_again(t)
        self.cores.read("after the search", self.on_event)
        again, records = self.ledger.remeasurements(), self.ledger.remeasurement_records()
        ranked = sorted(done, key=lambda t: -statistics.median(self.measurements(t, again)))

        def cpu_times(t: Any) -> list[Any]:
            return [t.user_attrs.get("cpu_step_time_s")] + [r.get("cpu_step_time_s") for r in records.get(t.user_attrs.get("plan_key", ""), [])]

        return Trust.of([(t.user_attrs.get("plan_key", ""), self.measurements(t, again), cpu_times(t)) for t in ranked[:2]],
                        load_1m=self._load or [os.getloadavg()[0]], cores=os.cpu_count() or 1, watch=self.cores)

    def _measure_again(self, t: Any) -> None:
        """Probe a COMPLETE trial's plan once more and record it in the study (a failure leaves the others standing)."""
        key = t.user_attrs.get("plan_key", "")
        cand = self.space.get(key)
        if cand is None:
            return
        self.on_event("remeasure", number=t.number, candidate=cand)
        self._load.append(os.getloadavg()[0])
        try:
            outcome = self.runner(cand.plan, trial_number=t.number, on_line=lambda line: self.on_event("line", text=line))
        except Exception as exc:  # noqa: BLE001 - a failed re-measurement leaves the first one standing
            self.on_event("warning", text=f"re-measuring {key} failed: {first_line(exc)}")
            return
        if outcome.ok and outcome.samples_per_second > 0:
            self.ledger.add_remeasurement(key, outcome.samples_per_second, cpu_step_time_s=outcome.cpu_step_time_s, load_average=outcome.load_average)
            self.on_event("remeasured", number=t.number, candidate=cand, samples_per_second=outcome.samples_per_second, outcome=outcome)
        else:
            self.on_event("warning", text=f"re-measuring {key} failed ({outcome.status}: {outcome.error[:120]}); its first measurement stands",
                          outcome=outcome)

    def gap(self, best: Any = None) -> Optional[Gap]:
        """How close the best plan found is believed to be to the best of the space: the best
        admissible plan not yet probed, predicted (scaled to the measurements) against it."""
        best = best if best is not None else self.best()
        if best is None:
            return None
        trials = self.ledger.trials()
        probed = []
        for t in trials:
            cand = self.space.get(t.user_attrs.get("plan_key", "")) if t.user_attrs.get("status") == "ok" else None
            if cand is not None and t.value is not None:
                probed.append((cand.predicted_samples_per_second, float(t.value)))
        unprobed = [(c.key, c.predicted_samples_per_second) for c in self.remaining(trials)]
        return predicted_gap(float(best.value), probed, unprobed)

    def _probe(self, trial: Any, cand: Candidate, *, source: str) -> bool:
        """Run the claimed trial's probe and record it; True if a probe ran."""
        self.on_event("start", number=trial.number, candidate=cand, source=source)
        self._load.append(os.getloadavg()[0])
        try:
            with heartbeat(self.study, trial):
                outcome = self.runner(cand.plan, trial_number=trial.number, on_line=lambda line: self.on_event("line", text=line))
        except KeyboardInterrupt:
            self._finish(trial, cand, ProbeOutcome(status="interrupted", error="interrupted by the user (Ctrl-C)"))
            raise
        except Exception as exc:  # noqa: BLE001 - a broken probe must never take the tuner down
            outcome = ProbeOutcome(status="error", error=f"probe raised {type(exc).__name__}: {first_line(exc)}")
        self._finish(trial, cand, outcome)
        return outcome.status in PROBED_STATUSES

    def _finish(self, trial: Any, cand: Candidate, outcome: ProbeOutcome) -> None:
        """Record the outcome in the trial and tell the study; then write the results."""
        from dataclasses import replace

        from optuna.trial import TrialState

        if outcome.ok and not outcome.samples_per_second > 0:
            # A probe that ran but timed nothing has no throughput to rank, report or export: it is
            # a failed measurement, never a plan at 0 samples/s.
            outcome = replace(outcome, status="error", error=NO_THROUGHPUT)
        measured = {
            "status": outcome.status,
            "probed": outcome.status in PROBED_STATUSES,
            "reason": outcome.error if not outcome.ok else "",
            "measured_samples_per_second": outcome.samples_per_second,
            "measured_tokens_per_second": outcome.tokens_per_second,
            "measured_step_time_s": outcome.step_time_s,
            "measured_peak_memory_bytes": outcome.peak_memory_bytes,
            "peak_memory_per_rank_bytes": list(outcome.peak_memory_per_rank_bytes),
            "host_peak_per_node": outcome.host_peak_per_node_bytes or None,
            "host_peak_per_rank": list(outcome.host_peak_per_rank_bytes),
            "estimated_host_peak_per_node": outcome.estimated_host_peak_per_node_bytes or None,
            "memory_limit": outcome.memory_limit or None,
            "probe_wall_s": round(outcome.wall_s, 3),
            "log_tail": outcome.log_tail[-_LOG_TAIL_CHARS:],
        }
        if outcome.ds_config:
            measured["ds_config"] = outcome.ds_config
        if outcome.trl:
            measured["trl"] = outcome.trl
        failure = classify_failure(
            outcome.status, outcome.error, engine_ready=outcome.engine_ready, optimizer_steps=outcome.optimizer_steps, cut_short=outcome.timeout_derived
        )
        if failure is not None:
            measured |= {"failure_kind": failure.kind, "failure_phase": failure.phase or "", "signature": failure.signature}
        if outcome.startup_s is not None:
            measured["startup_s"] = round(outcome.startup_s, 3)
        if outcome.step_time_ci_s is not None:
            measured |= {"step_time_ci_s": outcome.step_time_ci_s, "micro_steps": outcome.micro_steps}
        if outcome.timeout_s:
            measured["timeout_s"] = round(outcome.timeout_s, 1)
        if outcome.waits_s:
            # Not the plan's (the warm server, an op build): left out of its timeout and timings.
            measured["waits_s"] = {k: round(v, 1) for k, v in outcome.waits_s.items()}
        if outcome.retried:
            measured["retried"] = outcome.retried
        if outcome.cpu_step_time_s:
            measured["cpu_step_time_s"] = outcome.cpu_step_time_s
        if outcome.load_average:
            measured["load_average"] = [round(float(x), 2) for x in outcome.load_average]
        self.ledger.set_attrs(trial, measured)
        if outcome.ok:
            self.ledger.tell(trial, outcome.samples_per_second)
        elif outcome.status in PROBED_STATUSES:  # oom, error (a measurement without throughput too), timeout
            # TPE learns only from COMPLETE and PRUNED trials (a FAIL one is invisible to it): a
            # probe that failed is PRUNED with a violated constraint, so TPE counts its plan among
            # the infeasible ones (samplers/_tpe/sampler.py _split_trials), as the memory rule's.
            with storage_call(f"writing trial #{trial.number}"):
                trial.set_constraint(failure_constraint(outcome.status), 1.0)
            self.ledger.tell(trial, state=TrialState.PRUNED)
        else:  # interrupted, invalid config: not a measurement of the plan; --resume retries it
            self.ledger.tell(trial, state=TrialState.FAIL)
        self.on_event("end", number=trial.number, candidate=cand, outcome=outcome)
        try:
            self.after_trial()
        except OSError as exc:  # a full disk must not lose the study; the next trial retries the write
            self.on_event("warning", text=f"could not write results: {exc}")
