"""The search loop: Optuna ask/tell over the plans the estimator says fit, one probe per trial.

Order of trials:

1. plans the estimator rules out are written into the study as PRUNED trials (with the reason and
   a positive ``memory`` constraint, so TPE learns where the infeasible region is) — never probed;
2. the estimator's best predictions are enqueued first (``study.enqueue_trial``), spread over the
   ZeRO stage/offload choices;
3. then the sampler (TPE by default) proposes; a proposal that is already claimed by another trial
   is recorded as FAIL "duplicate" (ignored by TPE) and after a few in a row the best-predicted
   untried plan is enqueued instead, so the search never stalls on a finite space.

Claims and workers: before probing, a trial writes its plan key, worker (``host:pid``) and
deadline into its user attrs, then re-reads the study: if another live or finished trial with a
lower number claims the same plan, it yields. Several ``zeroplan tune`` processes on one storage
therefore never probe the same plan twice. ``--resume`` marks RUNNING trials whose worker is gone
(dead pid on this host, or past its probe deadline) as FAIL "interrupted" and enqueues them again.

An OOM teaches the search: larger micro-batches (or the same one with less checkpointing) at the
same stage/offload are recorded as PRUNED "larger than an OOM'd micro-batch" without a probe.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from zeroplan.spec import SpecError
from zeroplan.tuner.objective import ProbeOutcome, Runner
from zeroplan.tuner.space import CHECKPOINTING_MEMORY_RANK, Candidate, SearchSpace, zero_choice
from zeroplan.tuner.storage import StorageError, this_worker

__all__ = ["TuneSettings", "TuneSummary", "Tuner", "make_sampler", "initial_candidates", "space_signature", "SAMPLERS"]

SAMPLERS = ("tpe", "random")

#: Statuses of trials that ran a probe (they count against --trials).
PROBED_STATUSES = ("ok", "oom", "error", "timeout")

#: Trials this long in RUNNING without a claim are considered abandoned (crash between ask and claim).
UNCLAIMED_GRACE_S = 300.0

_LOG_TAIL_CHARS = 2000


@dataclass(frozen=True)
class TuneSettings:
    """How long to search and how."""

    trials: int = 8
    """Probes the study should hold (all workers together); pruned/duplicate trials do not count."""
    time_budget_s: Optional[float] = None
    """No new probe starts after this many seconds of this process's run (None: no limit)."""
    n_initial: Optional[int] = None
    """Estimator-ranked plans enqueued before the sampler (None: ceil(trials / 2))."""
    probe_timeout_s: float = 300.0
    """Per-probe timeout, used for the claim deadline other workers check."""
    max_rejections: int = 3
    """Sampler proposals rejected in a row before the best-predicted untried plan is enqueued."""
    stale_grace_s: float = 120.0
    """Extra seconds past a claim's probe timeout before another worker may declare it dead."""

    def __post_init__(self) -> None:
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise SpecError(f"--trials {self.trials!r} is not valid; give a whole number >= 1")
        if self.time_budget_s is not None and not (math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
            raise SpecError(f"--time-budget {self.time_budget_s} is not valid; give seconds > 0")
        if self.n_initial is not None and self.n_initial < 0:
            raise SpecError(f"n_initial={self.n_initial} must be >= 0")
        if not (math.isfinite(self.probe_timeout_s) and self.probe_timeout_s > 0):
            raise SpecError(f"--timeout {self.probe_timeout_s} is not valid; give seconds > 0")

    @property
    def initial(self) -> int:
        return self.n_initial if self.n_initial is not None else max(1, math.ceil(self.trials / 2))


@dataclass
class TuneSummary:
    """What a run of :meth:`Tuner.run` did."""

    probes_in_study: int
    """Trials in the study that ran a probe (all workers, all runs)."""
    probes_this_run: int
    """Probes this process ran."""
    stopped_because: str
    """trials reached | time budget | space exhausted | interrupted."""
    best_number: Optional[int] = None
    best_value: Optional[float] = None
    best_plan_key: Optional[str] = None
    wall_s: float = 0.0
    events: list[str] = field(default_factory=list)


def make_sampler(name: str = "tpe", *, seed: Optional[int] = None, n_startup_trials: int = 3) -> Any:
    """The Optuna sampler for ``--sampler``: TPE (multivariate, constant liar for parallel workers) or random.

    TPE's random start-up is short (3 trials, the estimator's picks included): the estimator's
    ranking already is the prior, so the model takes over as soon as a few probes are measured.
    """
    import optuna

    if name == "tpe":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # multivariate/constant_liar are flagged experimental
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True, n_startup_trials=n_startup_trials)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise SpecError(f"--sampler {name!r} is not valid; choose one of {', '.join(SAMPLERS)}")


def initial_candidates(space: SearchSpace, n: int) -> list[Candidate]:
    """The first ``n`` plans to probe: the predicted-fastest, then the predicted-fastest of each
    other stage/offload choice (so early probes span the space), then the rest by prediction."""
    fitting = space.fitting
    if n <= 0 or not fitting:
        return []
    chosen: list[Candidate] = [fitting[0]]
    seen_zero = {zero_choice(fitting[0].plan)}
    for cand in fitting[1:]:
        z = zero_choice(cand.plan)
        if z not in seen_zero:
            seen_zero.add(z)
            chosen.append(cand)
    keys = {c.key for c in chosen}
    chosen.extend(c for c in fitting if c.key not in keys)
    return chosen[:n]


def space_signature(space: SearchSpace) -> str:
    """Digest of what makes two runs' trials comparable (model, world size, batch, choices)."""
    blob = json.dumps(
        {
            "params": space.model.params,
            "hidden": space.model.hidden_size,
            "layers": space.model.num_layers,
            "gpus": space.cluster.gpus,
            "seq_len": space.training.seq_len,
            "global_batch": space.training.global_batch,
            "grad_accum": space.training.grad_accum,
            "precision": space.training.precision,
            "zero": space.zero_choices,
            "checkpointing": space.checkpointing_choices,
            "micro_batch": space.micro_batches,
            "buckets": space.bucket_sizes,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Tuner:
    """One worker of a tuning study. ``prepare()`` once, then ``run()``."""

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
    ) -> None:
        self.study = study
        self.space = space
        self.runner = runner
        self.settings = settings
        self.on_event = on_event or (lambda kind, **data: None)
        self.after_trial = after_trial or (lambda: None)
        self.clock = clock
        self.worker = this_worker()
        self._host = self.worker.rsplit(":", 1)[0]

    # ------------------------------------------------------------------ study helpers

    def _trials(self) -> list[Any]:
        try:
            return self.study.get_trials(deepcopy=False)
        except Exception as exc:  # noqa: BLE001 - storage failures of every kind become one line
            raise StorageError(f"the study storage failed while reading trials ({_first_line(exc)})") from None

    def _is_stale(self, t: Any, now: float) -> bool:
        """A RUNNING trial whose worker is gone."""
        attrs = t.user_attrs
        worker = attrs.get("worker")
        if worker is None:
            start = t.datetime_start.timestamp() if t.datetime_start else now
            return now - start > UNCLAIMED_GRACE_S
        host, _, pid = str(worker).rpartition(":")
        if host == self._host and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            return True
        return now > float(attrs.get("deadline_unix", math.inf))

    def _holds_claim(self, t: Any, now: float) -> bool:
        """The trial owns its plan: probed (any outcome), config invalid, or running live."""
        from optuna.trial import TrialState

        attrs = t.user_attrs
        if "plan_key" not in attrs:
            return False
        if t.state == TrialState.RUNNING:
            return "worker" in attrs and not self._is_stale(t, now)
        return attrs.get("status") in PROBED_STATUSES + ("invalid",)

    def probes_in_study(self, trials: Optional[list[Any]] = None) -> int:
        """Probed trials plus live claimed ones (so workers together stop at --trials)."""
        from optuna.trial import TrialState

        now = self.clock()
        count = 0
        for t in trials if trials is not None else self._trials():
            if t.user_attrs.get("status") in PROBED_STATUSES and t.state != TrialState.RUNNING:
                count += 1
            elif t.state == TrialState.RUNNING and self._holds_claim(t, now):
                count += 1
        return count

    def _ooms(self, trials: list[Any]) -> list[tuple[int, Candidate]]:
        out = []
        for t in trials:
            if t.user_attrs.get("status") == "oom":
                cand = self.space.get(t.user_attrs.get("plan_key", ""))
                if cand is not None:
                    out.append((t.number, cand))
        return out

    def _oom_rule(self, cand: Candidate, ooms: list[tuple[int, Candidate]]) -> Optional[str]:
        """Reason to skip ``cand`` because a plan needing no more memory already OOM'd."""
        for number, bad in ooms:
            if bad.key == cand.key:
                continue
            same_zero = zero_choice(bad.plan) == zero_choice(cand.plan)
            if (
                same_zero
                and cand.plan.micro_batch >= bad.plan.micro_batch
                and CHECKPOINTING_MEMORY_RANK[cand.plan.checkpointing] <= CHECKPOINTING_MEMORY_RANK[bad.plan.checkpointing]
            ):
                return f"larger than an OOM'd micro-batch (trial #{number}: {bad.plan.label})"
        return None

    def remaining(self, trials: Optional[list[Any]] = None) -> list[Candidate]:
        """Fitting candidates nobody has claimed and the OOM rule does not exclude, best predicted first."""
        trials = trials if trials is not None else self._trials()
        now = self.clock()
        claimed = {t.user_attrs.get("plan_key") for t in trials if self._holds_claim(t, now)}
        ooms = self._ooms(trials)
        return [c for c in self.space.fitting if c.key not in claimed and self._oom_rule(c, ooms) is None]

    # ------------------------------------------------------------------ setup

    def prepare(self, *, resume: bool) -> list[str]:
        """Check the study matches this space, recover crashed trials (resume), seed a new study."""
        from optuna.trial import TrialState, create_trial

        messages: list[str] = []
        signature = space_signature(self.space)
        try:
            stored = self.study.user_attrs.get("space_signature")
            if stored is not None and stored != signature:
                raise StorageError(
                    "the study in this storage was made for a different model, batch or search space "
                    f"(signature {stored} ≠ {signature}); choose another --output/--storage"
                )
            if resume:
                messages.extend(self._recover())
            if not self.study.user_attrs.get("zeroplan_seeded"):
                self.study.set_user_attr("space_signature", signature)
                self.study.set_user_attr("zeroplan_seeded", True)
                dists = self.space.distributions()
                gpu_bytes = self.space.cluster.gpu_memory_bytes
                for cand in self.space.pruned:
                    over = max(cand.predicted_peak_memory_bytes / gpu_bytes - 1.0, 0.01)
                    self.study.add_trial(
                        create_trial(
                            state=TrialState.PRUNED,
                            params=cand.params,
                            distributions=dists,
                            user_attrs=self._candidate_attrs(cand, source="estimator")
                            | {"status": "pruned", "reason": cand.reason, "probed": False},
                            constraints={"memory": over},
                        )
                    )
                initial = initial_candidates(self.space, self.settings.initial)
                for cand in initial:
                    self.study.enqueue_trial(cand.params, user_attrs={"source": "estimator"})
                messages.append(
                    f"new study: {len(self.space.candidates)} plans, {len(self.space.pruned)} pruned by the "
                    f"estimator, {len(initial)} best predictions enqueued first"
                )
        except StorageError:
            raise
        except SpecError:
            raise
        except Exception as exc:  # noqa: BLE001 - storage failures of every kind become one line
            raise StorageError(f"the study storage failed while preparing the study ({_first_line(exc)})") from None
        return messages

    def _recover(self) -> list[str]:
        """Mark RUNNING trials of dead workers FAIL "interrupted"; enqueue every interrupted plan again."""
        import optuna
        from optuna.trial import TrialState

        messages = []
        now = self.clock()
        for t in self._trials():
            if t.state == TrialState.RUNNING and self._is_stale(t, now):
                trial = optuna.Trial(self.study, t._trial_id)
                trial.set_user_attr("status", "interrupted")
                trial.set_user_attr("reason", f"worker {t.user_attrs.get('worker', '?')} stopped during the trial")
                trial.set_user_attr("probed", False)
                self.study.tell(t.number, state=TrialState.FAIL)
                messages.append(f"trial #{t.number} was left running by a stopped worker: marked FAIL, will retry")
        trials = self._trials()
        now = self.clock()
        claimed = {t.user_attrs.get("plan_key") for t in trials if self._holds_claim(t, now)}
        retried = {t.user_attrs.get("retry_of") for t in trials if "retry_of" in t.user_attrs}
        waiting = {
            json.dumps(t.system_attrs.get("fixed_params", {}), sort_keys=True)
            for t in trials
            if t.state == TrialState.WAITING
        }
        for t in trials:
            if t.state != TrialState.FAIL or t.user_attrs.get("status") != "interrupted":
                continue
            key = t.user_attrs.get("plan_key")
            if key in claimed or t.number in retried or not t.params:
                continue
            if json.dumps(t.params, sort_keys=True) in waiting:
                continue
            self.study.enqueue_trial(dict(t.params), user_attrs={"source": "retry", "retry_of": t.number})
            waiting.add(json.dumps(t.params, sort_keys=True))
            claimed.add(key)
            messages.append(f"re-enqueued {key} (interrupted in trial #{t.number})")
        return messages

    # ------------------------------------------------------------------ the loop

    def _candidate_attrs(self, cand: Candidate, *, source: str) -> dict[str, Any]:
        return {
            "plan_key": cand.key,
            "plan": cand.plan.as_dict(),
            "source": source,
            "predicted_samples_per_second": cand.predicted_samples_per_second,
            "predicted_peak_memory_bytes": cand.predicted_peak_memory_bytes,
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
        return params

    def _set_attrs(self, trial: Any, attrs: dict[str, Any]) -> None:
        for key, value in attrs.items():
            trial.set_user_attr(key, value)

    def _reject(self, trial: Any, *, state: Any, status: str, reason: str, attrs: dict[str, Any], constraint: Optional[tuple[str, float]] = None) -> None:
        self._set_attrs(trial, attrs | {"status": status, "reason": reason, "probed": False})
        if constraint is not None:
            trial.set_constraint(*constraint)
        self.study.tell(trial, state=state)
        self.on_event("skip", number=trial.number, key=attrs.get("plan_key", ""), status=status, reason=reason)

    def _enqueue_fallback(self, trials: list[Any]) -> bool:
        """Enqueue the best-predicted plan nobody has claimed or enqueued; False if none is left."""
        from optuna.trial import TrialState

        waiting = {
            json.dumps(t.system_attrs.get("fixed_params", {}), sort_keys=True) for t in trials if t.state == TrialState.WAITING
        }
        for cand in self.remaining(trials):
            if json.dumps(cand.params, sort_keys=True) not in waiting:
                self.study.enqueue_trial(cand.params, user_attrs={"source": "fallback"})
                return True
        return False

    def run(self) -> TuneSummary:
        """Probe until the study holds ``trials`` probes, the time budget ends or no plan is left."""
        try:
            return self._run()
        except (StorageError, SpecError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - Optuna/SQLAlchemy storage failures
            if type(exc).__module__.split(".")[0] in ("sqlalchemy", "optuna", "sqlite3"):
                raise StorageError(f"the study storage failed ({_first_line(exc)})") from None
            raise

    def _run(self) -> TuneSummary:
        from optuna.trial import TrialState

        start = time.monotonic()
        probes_this_run = 0
        rejections = 0
        stopped = "trials reached"
        while True:
            trials = self._trials()
            if self.probes_in_study(trials) >= self.settings.trials:
                stopped = "trials reached"
                break
            if self.settings.time_budget_s is not None and time.monotonic() - start >= self.settings.time_budget_s:
                stopped = "time budget"
                break
            if not self.remaining(trials):
                stopped = "space exhausted"
                break
            if rejections >= self.settings.max_rejections:
                rejections = 0
                self._enqueue_fallback(trials)

            trial = self.study.ask()
            try:
                params = self._suggest(trial)
            except ValueError as exc:
                self.study.tell(trial, state=TrialState.FAIL)
                raise StorageError(
                    f"the study's parameters do not match this search space ({_first_line(exc)}); "
                    "choose another --output/--storage"
                ) from None
            source = trial.user_attrs.get("source", "sampler")
            cand = self.space.candidate_for(params)
            if cand is None:
                rejections += 1
                self._reject(
                    trial,
                    state=TrialState.PRUNED,
                    status="pruned",
                    reason="not a plan the estimator enumerates for this model and batch",
                    attrs={"plan_key": "", "source": source},
                    constraint=("memory", 1.0),
                )
                continue
            attrs = self._candidate_attrs(cand, source=source)
            if not cand.fits:
                rejections += 1
                over = max(cand.predicted_peak_memory_bytes / self.space.cluster.gpu_memory_bytes - 1.0, 0.01)
                self._reject(trial, state=TrialState.PRUNED, status="pruned", reason=cand.reason, attrs=attrs, constraint=("memory", over))
                continue
            oom_reason = self._oom_rule(cand, self._ooms(trials))
            if oom_reason is not None:
                rejections += 1
                self._reject(trial, state=TrialState.PRUNED, status="pruned", reason=oom_reason, attrs=attrs, constraint=("oom", 1.0))
                continue

            now = self.clock()
            holder = next((t.number for t in trials if t.user_attrs.get("plan_key") == cand.key and self._holds_claim(t, now)), None)
            if holder is not None:
                rejections += 1
                self._reject(
                    trial,
                    state=TrialState.FAIL,
                    status="duplicate",
                    reason=f"plan already claimed by trial #{holder}",
                    attrs={"plan_key": cand.key, "source": source},
                )
                continue

            # Claim the plan, then look for an earlier claim on the same plan by any worker (the
            # snapshot above may predate another worker's claim).
            self._set_attrs(
                trial,
                attrs
                | {
                    "worker": self.worker,
                    "claimed_at_unix": now,
                    "deadline_unix": now + self.settings.probe_timeout_s + self.settings.stale_grace_s,
                },
            )
            holder = self._earlier_claim(trial.number, cand.key)
            if holder is not None:
                rejections += 1
                self._reject(
                    trial,
                    state=TrialState.FAIL,
                    status="duplicate",
                    reason=f"plan already claimed by trial #{holder}",
                    attrs={"plan_key": cand.key, "source": source},
                )
                continue
            if self._slots_taken_before(trial.number) >= self.settings.trials:
                # Another worker took the last slot between our check and our claim.
                self._reject(
                    trial, state=TrialState.FAIL, status="duplicate", reason="--trials reached by other workers", attrs={"plan_key": cand.key, "source": source}
                )
                stopped = "trials reached"
                break

            rejections = 0
            self.on_event("start", number=trial.number, candidate=cand, source=source)
            try:
                outcome = self.runner(cand.plan, trial_number=trial.number, on_line=lambda line: self.on_event("line", text=line))
            except KeyboardInterrupt:
                self._finish(trial, cand, ProbeOutcome(status="interrupted", error="interrupted by the user (Ctrl-C)"))
                raise
            except Exception as exc:  # noqa: BLE001 - a broken probe must never take the tuner down
                outcome = ProbeOutcome(status="error", error=f"probe raised {type(exc).__name__}: {_first_line(exc)}")
            probes_this_run += outcome.status in PROBED_STATUSES
            self._finish(trial, cand, outcome)

        best = self.best()
        return TuneSummary(
            probes_in_study=self.probes_in_study(),
            probes_this_run=probes_this_run,
            stopped_because=stopped,
            best_number=best.number if best else None,
            best_value=best.value if best else None,
            best_plan_key=best.user_attrs.get("plan_key") if best else None,
            wall_s=time.monotonic() - start,
        )

    def _slots_taken_before(self, number: int) -> int:
        """Probes finished plus live claims of lower-numbered trials (first claimants win the last slots)."""
        from optuna.trial import TrialState

        now = self.clock()
        count = 0
        for t in self._trials():
            if t.state == TrialState.RUNNING:
                count += t.number < number and self._holds_claim(t, now)
            elif t.user_attrs.get("status") in PROBED_STATUSES:
                count += 1
        return count

    def _earlier_claim(self, number: int, key: str) -> Optional[int]:
        from optuna.trial import TrialState

        now = self.clock()
        for t in self._trials():
            if t.number == number or t.user_attrs.get("plan_key") != key or not self._holds_claim(t, now):
                continue
            if t.state != TrialState.RUNNING or t.number < number:
                return t.number
        return None

    def _finish(self, trial: Any, cand: Candidate, outcome: ProbeOutcome) -> None:
        """Record the outcome in the trial and tell the study; then write the results."""
        from optuna.trial import TrialState

        measured = {
            "status": outcome.status,
            "probed": outcome.status in PROBED_STATUSES,
            "reason": outcome.error if not outcome.ok else "",
            "measured_samples_per_second": outcome.samples_per_second,
            "measured_tokens_per_second": outcome.tokens_per_second,
            "measured_step_time_s": outcome.step_time_s,
            "measured_peak_memory_bytes": outcome.peak_memory_bytes,
            "peak_memory_per_rank_bytes": list(outcome.peak_memory_per_rank_bytes),
            "probe_wall_s": round(outcome.wall_s, 3),
            "log_tail": outcome.log_tail[-_LOG_TAIL_CHARS:],
        }
        if outcome.ds_config:
            measured["ds_config"] = outcome.ds_config
        self._set_attrs(trial, measured)
        if outcome.ok and outcome.samples_per_second > 0:
            self.study.tell(trial, outcome.samples_per_second)
        else:
            if outcome.ok:
                trial.set_user_attr("reason", "probe reported no throughput")
            self.study.tell(trial, state=TrialState.FAIL)
        self.on_event("end", number=trial.number, candidate=cand, outcome=outcome)
        try:
            self.after_trial()
        except OSError as exc:  # a full disk must not lose the study; the next trial retries the write
            self.on_event("warning", text=f"could not write results: {exc}")

    def best(self) -> Any:
        """The COMPLETE trial with the highest measured throughput, or None."""
        from optuna.trial import TrialState

        done = [t for t in self._trials() if t.state == TrialState.COMPLETE and t.value is not None]
        return max(done, key=lambda t: t.value) if done else None


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
