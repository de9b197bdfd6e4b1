"""The claims ledger: which worker owns which plan in a shared Optuna study.

Several ``zeroplan tune`` processes (one per node, or several on one machine) may share one
storage. Before probing, a trial writes a *claim* into its user attrs — the plan key, the worker
(``host:pid``) and a deadline — and then re-reads the study: a finished claim on the plan wins, then
the lowest-numbered live one, except that a higher-numbered claim already checked (its worker read
the study before this claim was written, and went on) wins too, and one not yet checked is waited
for (:meth:`ClaimsLedger.confirm`); so no plan is probed twice, nor one past ``--trials``. A claim
of a RUNNING trial stops counting when its worker is provably gone (a dead pid on this host) or its
deadline has passed.

Every call into the storage goes through :func:`storage_call`, which turns the storage's own
failures (SQLAlchemy, SQLite, a journal file) into one :class:`StorageError` line; nothing outside
a storage call is translated, so a programming error keeps its traceback.
Only Optuna's public API is used (``Study.get_trials``/``ask``/``tell``/``enqueue_trial``/
``add_trial``, ``Trial.set_user_attr``, ``Trial.set_constraint``); a stale trial is failed by its number.
"""

from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

from zeroplan.spec import SpecError
from zeroplan.tuner.objective import PROBED_STATUSES
from zeroplan.tuner.storage import StorageError, this_worker

__all__ = ["CHECKED", "CHECK_WAIT_S", "ClaimsLedger", "ENQUEUED_PARAMS", "ONCE_SEPARATOR", "REMEASURED_ATTR", "UNCLAIMED_GRACE_S",
           "remeasurements", "storage_call", "trial_status", "trial_reason", "first_line"]

#: User attr of an enqueued trial holding its parameters (read back by :meth:`ClaimsLedger.waiting_params`).
ENQUEUED_PARAMS = "enqueued_params"

#: Prefix of the study attributes holding re-measurements (a finished trial's attributes cannot
#: change in Optuna, the study's can). Each re-measurement is its own attribute,
#: ``<prefix>/<plan key>/<worker>/<random id>`` → {"samples_per_second": v, "time": t}: workers sharing a
#: study never read-modify-write one value, so none overwrites another's (a single
#: {plan: [values]} attribute, read before a re-measurement and written after, lost the
#: measurements another worker stored meanwhile). An attribute named exactly the prefix holding
#: {plan key: [samples/s, ...]} (studies written before) is read too.
REMEASURED_ATTR = "remeasured_samples_per_second"


def remeasurement_records(study_attrs: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """{plan key: [{"samples_per_second", "cpu_step_time_s", "load_average", "time"}, ...]} from a study's
    user attributes, each plan's in the order measured (keys other than samples/s may be absent)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key, values in (study_attrs.get(REMEASURED_ATTR) or {}).items():
        out.setdefault(key, []).extend({"samples_per_second": float(v), "time": -1.0} for v in values)
    for name, value in study_attrs.items():
        if name.startswith(REMEASURED_ATTR + "/") and isinstance(value, dict):
            out.setdefault(name[len(REMEASURED_ATTR) + 1:].rsplit("/", 2)[0], []).append(value)
    return {plan: sorted(records, key=lambda r: float(r.get("time", 0.0))) for plan, records in out.items()}


def remeasurements(study_attrs: dict[str, Any]) -> dict[str, list[float]]:
    """{plan key: [samples/s, ...]} from a study's user attributes, each plan's in the order measured."""
    return {plan: [float(r["samples_per_second"]) for r in records] for plan, records in remeasurement_records(study_attrs).items()}


#: Trials this long in RUNNING without a claim are considered abandoned (crash between ask and claim).
UNCLAIMED_GRACE_S = 300.0

#: User attr a claimant writes once it has read the study after its claim and goes on to probe.
CHECKED = "claim_checked"

#: Longest wait for a higher-numbered trial's claim to be checked (:meth:`ClaimsLedger.settle`).
CHECK_WAIT_S = 60.0

#: Between a study's name and a once-per-study task in the name of the task's marker study
#: (:meth:`ClaimsLedger.claim_once`): ``zeroplan#seeding``.
ONCE_SEPARATOR = "#"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (SQLAlchemy's wrapped ``orig`` when there is one)."""
    text = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@contextmanager
def storage_call(what: str) -> Iterator[None]:
    """Turn a failure of the storage during ``what`` into one :class:`StorageError` line.

    Use it around calls into the study only: the storage backends raise errors of every kind
    (``sqlalchemy.exc.*``, ``sqlite3.*``, ``OSError``, ``ValueError`` from a torn journal line).
    """
    try:
        yield
    except (SpecError, KeyboardInterrupt):
        raise
    except Exception as exc:  # noqa: BLE001 - storage failures of every kind become one line
        raise StorageError(f"the study storage failed while {what} ({first_line(exc)})") from None


def trial_status(t: Any) -> str:
    """A trial's zeroplan status: its ``status`` attr; ``interrupted`` for a FAIL trial without one
    (its worker died mid-trial and a resuming worker failed it, see :meth:`ClaimsLedger.recover`);
    else the Optuna state in lower case (``running``, ``waiting``)."""
    status = t.user_attrs.get("status")
    if status:
        return str(status)
    state = t.state.name
    if state == "FAIL":
        return "interrupted"
    return state.lower()


def trial_reason(t: Any) -> str:
    """Why a trial ended as it did: its ``reason`` attr, or the interruption's."""
    reason = t.user_attrs.get("reason")
    if reason is None and trial_status(t) == "interrupted":
        return f"worker {t.user_attrs.get('worker', '?')} stopped during the trial"
    return str(reason or "")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ClaimsLedger:
    """The study seen as a ledger of plan claims, for one worker."""

    def __init__(self, study: Any, *, clock: Callable[[], float], worker: Optional[str] = None) -> None:
        self.study = study
        self.clock = clock
        self.worker = worker or this_worker()
        self._host = self.worker.rsplit(":", 1)[0]

    # ------------------------------------------------------------------ storage calls

    def trials(self) -> list[Any]:
        with storage_call("reading trials"):
            return self.study.get_trials(deepcopy=False)

    def study_attr(self, name: str) -> Any:
        with storage_call("reading the study"):
            return self.study.user_attrs.get(name)

    def set_study_attr(self, name: str, value: Any) -> None:
        with storage_call("writing the study"):
            self.study.set_user_attr(name, value)

    def add_remeasurement(self, plan_key: str, samples_per_second: float, *, cpu_step_time_s: Optional[float] = None,
                          load_average: Optional[tuple] = None) -> None:
        """Store one more measurement of ``plan_key`` under an attribute no other worker writes."""
        import time
        import uuid

        name = f"{REMEASURED_ATTR}/{plan_key}/{this_worker()}/{uuid.uuid4().hex[:12]}"
        record = {"samples_per_second": float(samples_per_second), "time": time.time()}
        if cpu_step_time_s:
            record["cpu_step_time_s"] = float(cpu_step_time_s)
        if load_average:
            record["load_average"] = [round(float(x), 2) for x in load_average]
        with storage_call("writing the study"):
            self.study.set_user_attr(name, record)

    def remeasurements(self) -> dict[str, list[float]]:
        """{plan key: [samples/s, ...]}: every worker's re-measurements (:func:`remeasurements`)."""
        with storage_call("reading the study"):
            return remeasurements(self.study.user_attrs)

    def remeasurement_records(self) -> dict[str, list[dict[str, Any]]]:
        """Every worker's re-measurements with their CPU time and load (:func:`remeasurement_records`)."""
        with storage_call("reading the study"):
            return remeasurement_records(self.study.user_attrs)

    def add_trial(self, frozen: Any) -> None:
        with storage_call("recording a pruned plan"):
            self.study.add_trial(frozen)

    def enqueue(self, params: dict[str, Any], user_attrs: dict[str, Any]) -> None:
        with storage_call("enqueueing a plan"):
            self.study.enqueue_trial(params, user_attrs=user_attrs | {ENQUEUED_PARAMS: dict(params)})

    def ask(self) -> Any:
        with storage_call("starting a trial"):
            return self.study.ask()

    def set_attrs(self, trial: Any, attrs: dict[str, Any]) -> None:
        with storage_call(f"writing trial #{trial.number}"):
            for key, value in attrs.items():
                trial.set_user_attr(key, value)

    def tell(self, trial: Any, value: Optional[float] = None, *, state: Any = None) -> None:
        number = trial if isinstance(trial, int) else trial.number
        with storage_call(f"finishing trial #{number}"):
            if value is not None:
                self.study.tell(trial, value)
            else:
                self.study.tell(trial, state=state, skip_if_finished=isinstance(trial, int))

    # ------------------------------------------------------------------ claims

    def claim_once(self, task: str) -> Optional[str]:
        """Claim ``task`` (done once per study, whichever worker gets there first): None when this
        worker won it and does it, else the worker (``host:pid``) that claimed it.

        A study attribute cannot be claimed (Optuna writes it without reading it, so two workers
        that both read it unset would both go on); a study name can: every storage refuses a second
        study of one name (RDB: a unique column; journal: the first record in the file wins; in
        memory: under its lock) with ``DuplicatedStudyError``. The claim is the study
        ``<name>#<task>``, holding the claimant in its ``worker`` attribute."""
        import optuna
        from optuna.study import StudyDirection

        storage = self.study._storage  # Optuna's storage API (create_new_study) is public; Study keeps it here
        name = f"{self.study.study_name}{ONCE_SEPARATOR}{task}"
        with storage_call(f"claiming the study's {task}"):
            try:
                marker = storage.create_new_study([StudyDirection.MAXIMIZE], name)
            except optuna.exceptions.DuplicatedStudyError:
                attrs = storage.get_study_user_attrs(storage.get_study_id_from_name(name))
                return str(attrs.get("worker", "?"))
            storage.set_study_user_attr(marker, "worker", self.worker)
        return None

    def worker_gone(self, worker: str) -> bool:
        """``worker`` (``host:pid``) is provably gone: a dead pid on this host."""
        host, _, pid = str(worker).rpartition(":")
        return host == self._host and pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid))

    def wait_study_attr(self, name: str, *, claimant: str, wait_s: float, poll_s: float = 0.05) -> bool:
        """Wait until the study holds attribute ``name`` (set by ``claimant`` once its task is done);
        False when ``wait_s`` passed first or the claimant is provably gone."""
        import time

        deadline = time.monotonic() + wait_s
        while not self.study_attr(name):
            if time.monotonic() >= deadline or self.worker_gone(claimant):
                return False
            time.sleep(poll_s)
        return True

    def is_stale(self, t: Any, now: float) -> bool:
        """A RUNNING trial whose worker is gone."""
        attrs = t.user_attrs
        worker = attrs.get("worker")
        if worker is None:
            start = t.datetime_start.timestamp() if t.datetime_start else now
            return now - start > UNCLAIMED_GRACE_S
        if self.worker_gone(worker):
            return True
        return now > float(attrs.get("deadline_unix", math.inf))

    def holds_claim(self, t: Any, now: float) -> bool:
        """The trial owns its plan: probed (any outcome), config invalid, or running live."""
        attrs = t.user_attrs
        if "plan_key" not in attrs:
            return False
        if t.state.name == "RUNNING":
            return "worker" in attrs and not self.is_stale(t, now)
        return attrs.get("status") in PROBED_STATUSES + ("invalid",)

    def claimed_keys(self, trials: list[Any]) -> set[str]:
        now = self.clock()
        return {t.user_attrs.get("plan_key") for t in trials if self.holds_claim(t, now)}

    def holder_of(self, key: str, trials: list[Any]) -> Optional[int]:
        """The number of a trial in ``trials`` that holds a claim on ``key``, or None."""
        now = self.clock()
        return next((t.number for t in trials if t.user_attrs.get("plan_key") == key and self.holds_claim(t, now)), None)

    def probes_in_study(self, trials: Optional[list[Any]] = None) -> int:
        """Probed trials plus live claimed ones (so workers together stop at --trials)."""
        now = self.clock()
        count = 0
        for t in trials if trials is not None else self.trials():
            running = t.state.name == "RUNNING"
            if not running and t.user_attrs.get("status") in PROBED_STATUSES:
                count += 1
            elif running and self.holds_claim(t, now):
                count += 1
        return count

    def claim(self, trial: Any, attrs: dict[str, Any], *, deadline_s: float) -> None:
        """Write the plan's attrs and this worker's claim (good for ``deadline_s`` seconds) into ``trial``."""
        now = self.clock()
        self.set_attrs(trial, attrs | {"worker": self.worker, "claimed_at_unix": now, "deadline_unix": now + deadline_s})

    # Two claimants of one plan (or of the last slot) each write their claim, then read the study.
    # The lower-numbered one wins, but only if the other sees it: a higher-numbered claimant that
    # read the study before the lower one's claim was written went on to probe, and the lower one,
    # finding only a higher-numbered rival, went on too (a plan probed twice, or --trials + 1
    # probes: seen with two workers under load). So a claimant that goes on marks its trial
    # :data:`CHECKED`, and the lower-numbered one, reading after its own claim, counts a
    # higher-numbered claim that is checked (it read before this claim existed) and waits for one
    # that is not (its read is still to come, and will see this claim). Waits only go to higher
    # numbers, so none waits on itself in a cycle.

    def settle(self, number: int, *, wait_s: float = CHECK_WAIT_S, poll_s: float = 0.05) -> list[Any]:
        """The study's trials once no live claim of a trial numbered above ``number`` is unchecked
        (or after ``wait_s``: such a claim then counts as checked)."""
        import time

        deadline = time.monotonic() + wait_s
        while True:
            trials = self.trials()
            now = self.clock()
            pending = [t for t in trials if t.number > number and t.state.name == "RUNNING" and self.holds_claim(t, now)
                       and not t.user_attrs.get(CHECKED)]
            if not pending or time.monotonic() >= deadline:
                return trials
            time.sleep(poll_s)

    def _wins_over(self, t: Any, number: int) -> bool:
        """Whether ``t``'s claim (held) comes before the claim of trial ``number``: it is finished,
        lower-numbered, or checked (see :meth:`settle`)."""
        return t.state.name != "RUNNING" or t.number < number or bool(t.user_attrs.get(CHECKED))

    def earlier_claim(self, number: int, key: str, trials: Optional[list[Any]] = None) -> Optional[int]:
        """A claim on ``key`` that comes before trial ``number``'s: finished, by a lower-numbered
        trial, or checked (pass ``trials`` from :meth:`settle`)."""
        now = self.clock()
        for t in trials if trials is not None else self.trials():
            if t.number == number or t.user_attrs.get("plan_key") != key or not self.holds_claim(t, now):
                continue
            if self._wins_over(t, number):
                return t.number
        return None

    def slots_taken_before(self, number: int, trials: Optional[list[Any]] = None) -> int:
        """Probes finished plus live claims that come before trial ``number``'s (lower-numbered or
        checked: first claimants win the last slots)."""
        now = self.clock()
        count = 0
        for t in trials if trials is not None else self.trials():
            if t.state.name == "RUNNING":
                count += t.number != number and self._wins_over(t, number) and self.holds_claim(t, now)
            elif t.user_attrs.get("status") in PROBED_STATUSES:
                count += 1
        return count

    def confirm(self, trial: Any, key: str, *, trials_limit: int) -> Optional[str]:
        """After :meth:`claim`: None when trial goes on to probe ``key`` (its claim is then marked
        :data:`CHECKED`), else why not (the caller rejects the trial): another trial's claim on the
        plan comes first, or claims before it fill ``trials_limit``."""
        trials = self.settle(trial.number)
        holder = self.earlier_claim(trial.number, key, trials)
        if holder is not None:
            return f"plan already claimed by trial #{holder}"
        if self.slots_taken_before(trial.number, trials) >= trials_limit:
            return "--trials reached by other workers"
        self.set_attrs(trial, {CHECKED: True})
        return None

    @staticmethod
    def waiting_params(trials: list[Any]) -> set[str]:
        """The parameters of enqueued, not yet started trials (as canonical JSON).

        Optuna keeps an enqueued trial's parameters in a private system attr; :meth:`enqueue`
        writes them into the trial's user attrs (``enqueued_params``) too, which are public.
        """
        return {
            json.dumps(t.user_attrs[ENQUEUED_PARAMS], sort_keys=True)
            for t in trials
            if t.state.name == "WAITING" and ENQUEUED_PARAMS in t.user_attrs
        }

    def enqueue_first_free(self, params_in_order: list[dict[str, Any]], trials: list[Any], *, source: str) -> bool:
        """Enqueue the first of ``params_in_order`` not already waiting; False if all are."""
        waiting = self.waiting_params(trials)
        for params in params_in_order:
            if json.dumps(params, sort_keys=True) not in waiting:
                self.enqueue(params, {"source": source})
                return True
        return False

    # ------------------------------------------------------------------ crash recovery

    def recover(self) -> list[str]:
        """Fail RUNNING trials of dead workers (status ``interrupted``); enqueue every interrupted
        plan again once, unless another trial holds it or it already waits."""
        messages = []
        now = self.clock()
        for t in self.trials():
            if t.state.name == "RUNNING" and self.is_stale(t, now):
                # By number, public API; skip_if_finished: another resuming worker may fail it first.
                self.tell(t.number, state=_trial_state("FAIL"))
                messages.append(f"trial #{t.number} was left running by a stopped worker: marked FAIL, will retry")
        trials = self.trials()
        claimed = self.claimed_keys(trials)
        retried = {t.user_attrs.get("retry_of") for t in trials if "retry_of" in t.user_attrs}
        # Retries Optuna's heartbeat callback (RetryHeartbeatStaleTrialCallback) already enqueued.
        retried |= {t.system_attrs.get("failed_trial") for t in trials if "failed_trial" in t.system_attrs}
        waiting = self.waiting_params(trials)
        for t in trials:
            if t.state.name != "FAIL" or trial_status(t) != "interrupted":
                continue
            key = t.user_attrs.get("plan_key")
            params = json.dumps(t.params, sort_keys=True)
            if key in claimed or t.number in retried or not t.params or params in waiting:
                continue
            self.enqueue(dict(t.params), {"source": "retry", "retry_of": t.number})
            waiting.add(params)
            claimed.add(key)
            messages.append(f"re-enqueued {key} (interrupted in trial #{t.number})")
        return messages


def _trial_state(name: str) -> Any:
    from optuna.trial import TrialState

    return TrialState[name]
