"""Several tune workers on one study: a worker SIGKILLed mid-trial costs one retry, never a
duplicate probe or a lost trial; storages that cannot be used are one line. Replayed probe
outcomes (tests/test_tuner_search.py's Replay) keep this cheap; real probes through the same
Tuner run in test_tuner_cli.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from zeroplan.tuner import StorageError, open_study, storage_url
from zeroplan.tuner.ledger import trial_status
from zeroplan.tuner.storage import GRACE_PERIOD_S, HEARTBEAT_INTERVAL_S, open_storage

from helpers import ROOT
PROBED = ("ok", "oom", "error", "timeout")

# ROLE victim: its second probe hangs (and says so) until the test SIGKILLs it.
# ROLE survivor: probes 0.2 s each; after its first probe it waits until the victim is dead.
WORKER = textwrap.dedent(
    """
    import os, sys, time, pathlib
    from helpers import Replay, make_space
    from zeroplan.tuner import TuneSettings, Tuner, make_sampler, open_study

    sync = pathlib.Path({sync!r})
    role = sys.argv[1]

    class Runner(Replay):
        def __call__(self, plan, **kw):
            if role == "victim" and len(self.calls) == 1:
                (sync / "hanging").write_text(str(kw["trial_number"]))
                time.sleep(600)
            if role == "survivor" and len(self.calls) == 1:
                while not (sync / "killed").exists():
                    time.sleep(0.05)
            time.sleep(0.2)
            return super().__call__(plan, **kw)

    study = open_study({url!r}, resume=True, sampler=make_sampler("tpe"))
    tuner = Tuner(study, make_space(), Runner(oom_from=None), TuneSettings(trials=8, n_initial=4))
    tuner.prepare(resume=True)
    (sync / role).touch()
    while not ((sync / "victim").exists() and (sync / "survivor").exists()):
        time.sleep(0.05)
    print(tuner.run().probes_this_run)
    """
)


def test_worker_killed_mid_trial_costs_one_retry_on_a_journal(tmp_path):
    journal = tmp_path / "study.journal"
    url = storage_url(str(journal), tmp_path)
    assert url.startswith("journal:")  # a plain path is Optuna's journal storage
    sync = tmp_path / "sync"
    sync.mkdir()
    code = WORKER.format(url=url, sync=str(sync))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    start = lambda role: subprocess.Popen(  # noqa: E731
        [sys.executable, "-c", code, role], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    victim, survivor = start("victim"), start("survivor")
    deadline = time.monotonic() + 120
    while not (sync / "hanging").exists() and time.monotonic() < deadline and victim.poll() is None:
        time.sleep(0.05)
    assert (sync / "hanging").exists(), victim.communicate()[1][-2000:]
    hung_trial = int((sync / "hanging").read_text())
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    (sync / "killed").touch()
    out, err = survivor.communicate(timeout=180)
    assert survivor.returncode == 0, err[-3000:]

    trials = open_study(url, resume=True, sampler=None).get_trials()
    probed = [t for t in trials if t.user_attrs.get("status") in PROBED]
    keys = [t.user_attrs["plan_key"] for t in probed]
    assert len(keys) == len(set(keys)) == 8, f"a plan was probed twice, or the study is short: {keys}"
    failed = [t for t in trials if t.state.name == "FAIL" and trial_status(t) == "interrupted"]
    assert [t.number for t in failed] == [hung_trial]  # the victim's trial, failed by the survivor
    # The interrupted plan is probed exactly once more, never lost: normally by one retry trial;
    # if the survivor claimed the same plan while the victim was starting it (both asked at
    # once, a race a loaded machine shows), the survivor's probe is that one and no retry is
    # enqueued (ledger.recover skips claimed plans).
    hung_key = failed[0].user_attrs["plan_key"]
    retries = [t for t in trials if t.user_attrs.get("retry_of") == hung_trial]
    assert hung_key in keys  # probed once (keys are unique above), so not lost
    assert len(retries) <= 1
    if retries:
        assert retries[0].user_attrs.get("status") == "ok" and retries[0].user_attrs["plan_key"] == hung_key
    else:
        holder = next(t for t in probed if t.user_attrs["plan_key"] == hung_key)
        assert holder.user_attrs.get("worker") != failed[0].user_attrs.get("worker")  # the survivor's probe
    assert not [t for t in trials if t.state.name in ("RUNNING", "WAITING")]


def test_rdb_storages_use_optunas_heartbeat(tmp_path):
    """SQLite (an RDB URL) gets Optuna's heartbeat and one-retry callback; the journal has none."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    rdb = open_storage(storage_url(None, tmp_path))
    assert rdb.get_heartbeat_interval() == HEARTBEAT_INTERVAL_S and rdb.grace_period == GRACE_PERIOD_S
    callback = rdb.get_heartbeat_stale_trial_callback()
    assert isinstance(callback, RetryHeartbeatStaleTrialCallback) and callback._max_retry == 1


def test_sqlite_file_given_as_a_path_is_one_line(tmp_path):
    import sqlite3

    db = tmp_path / "old.db"
    sqlite3.connect(db).execute("create table t (x)").connection.commit()
    before = db.read_bytes()
    with pytest.raises(StorageError, match=r"is a SQLite database; a plain path is an Optuna journal file: give --storage sqlite:///"):
        open_storage(storage_url(str(db), tmp_path))
    assert db.read_bytes() == before


def test_unreachable_storage_exits_2_and_leaves_the_study_intact(tmp_path):
    journal = tmp_path / "study.journal"
    open_study(storage_url(str(journal), tmp_path), resume=False, sampler=None).enqueue_trial({"x": 1})
    before = journal.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "zeroplan", "tune", "examples/gpt_task.py", "--gpus", "2", "--output", str(tmp_path / "o")]
    for storage, needle in (
        ("postgresql://zeroplan@127.0.0.1:1/none", "--storage postgresql://zeroplan@127.0.0.1:1/none: cannot open the study storage"),
        (str(journal), "already holds 1 trials; pass --resume"),
    ):
        r = subprocess.run(base + ["--storage", storage], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
        assert r.returncode == 2, r.stdout + r.stderr
        assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert journal.read_bytes() == before


def test_two_workers_never_pop_the_same_enqueued_trial_on_sqlite(tmp_path):
    """Optuna pops an enqueued trial by reading its state and writing RUNNING only if it read
    WAITING (``RDBStorage.set_trial_state_values``; ``SELECT ... FOR UPDATE``, which SQLite
    ignores). Through pysqlite the read runs outside the write's transaction, so a worker paused
    between its read and its write, while another pops the same trial, wrote RUNNING over it and
    both probed one trial (seen under load as "Cannot tell a COMPLETE trial" / "Trial#N has already
    finished", or one probe too many). Two storages on one file, two threads, the interleaving
    forced with SQLAlchemy's statement hook: exactly one of them gets the enqueued trial."""
    import threading

    import optuna
    import sqlalchemy

    url = storage_url(None, tmp_path)
    open_study(url, resume=False, sampler=None).enqueue_trial({"x": 1})
    storages = [open_storage(url) for _ in range(2)]
    studies = [optuna.load_study(storage=storage, study_name="zeroplan") for storage in storages]
    b_between_read_and_write, a_done = threading.Event(), threading.Event()

    def pause_before_popping(conn, cursor, statement, parameters, context, executemany):
        if statement.startswith("UPDATE trials SET state") and not b_between_read_and_write.is_set():
            b_between_read_and_write.set()
            a_done.wait(timeout=3.0)  # with the fix worker A cannot pop while B holds its transaction

    sqlalchemy.event.listen(storages[1].engine, "before_cursor_execute", pause_before_popping)
    asked: dict[str, int] = {}

    def ask(name: str, study) -> None:
        asked[name] = study.ask().number
        if name == "a":
            a_done.set()

    b = threading.Thread(target=ask, args=("b", studies[1]))
    b.start()
    assert b_between_read_and_write.wait(timeout=60)
    a = threading.Thread(target=ask, args=("a", studies[0]))
    a.start()
    a.join(timeout=60)
    b.join(timeout=60)
    assert sorted(asked.values()) == [0, 1], f"both workers popped trial #{asked.get('a')}: {asked}"
    trials = studies[0].get_trials()
    assert [t.state.name for t in trials] == ["RUNNING", "RUNNING"]
    assert trials[0].system_attrs["fixed_params"] == {"x": 1} and "fixed_params" not in trials[1].system_attrs


def _two_claimants(tmp_path):
    """Two workers' ledgers on one journal study (other hosts' workers: alive while their deadline
    runs), each with a trial asked: (study, [(ledger, trial), (ledger, trial)]) in trial order."""
    from zeroplan.tuner.ledger import ClaimsLedger

    study = open_study(storage_url(str(tmp_path / "study.journal"), tmp_path), resume=False, sampler=None)
    out = []
    for worker in ("node-a:1", "node-b:2"):
        ledger = ClaimsLedger(study, clock=time.time, worker=worker)
        out.append((ledger, ledger.ask()))
    return study, out


def _claim(ledger, trial, key):
    ledger.claim(trial, {"plan_key": key}, deadline_s=300)


@pytest.mark.parametrize("keys, limit", [(("z1/mb4", "z1/mb4"), 8), (("z1/mb4", "z2/mb8"), 1)], ids=["one plan", "the last slot"])
def test_a_claim_read_before_a_lower_numbered_claim_was_written_still_wins_alone(tmp_path, keys, limit):
    """Worker B (trial #1) claims and reads the study before worker A (trial #0, asked first but
    slowed down) has written its claim, so B sees no rival and goes on; A then claims, reads, and
    finds only a higher-numbered claim. Lower-numbered-wins alone let A go on too: one plan probed
    twice, or one probe past --trials (seen with two tune processes on a loaded machine). B's
    claim is checked, so A yields to it."""
    study, ((a, trial_a), (b, trial_b)) = _two_claimants(tmp_path)
    _claim(b, trial_b, keys[1])
    assert b.confirm(trial_b, keys[1], trials_limit=limit) is None  # B saw no other claim
    _claim(a, trial_a, keys[0])
    why_not = a.confirm(trial_a, keys[0], trials_limit=limit)
    assert why_not is not None, "both workers went on to probe"
    assert why_not == ("plan already claimed by trial #1" if keys[0] == keys[1] else "--trials reached by other workers")


def test_a_lower_numbered_claim_waits_for_a_higher_ones_check_and_wins(tmp_path):
    """Both claims written before either reads: A (#0) finds B's claim unchecked, so B's read is
    still to come and will see A's claim; A waits for it, B yields to the lower number, A goes on."""
    import threading

    from optuna.trial import TrialState

    study, ((a, trial_a), (b, trial_b)) = _two_claimants(tmp_path)
    _claim(a, trial_a, "z1/mb4")
    _claim(b, trial_b, "z1/mb4")
    verdict: dict[str, object] = {}
    waiter = threading.Thread(target=lambda: verdict.setdefault("a", a.confirm(trial_a, "z1/mb4", trials_limit=8)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and "a" not in verdict  # waiting on B's check
    assert b.confirm(trial_b, "z1/mb4", trials_limit=8) == "plan already claimed by trial #0"
    b.tell(trial_b, state=TrialState.FAIL)  # what the loop's rejection does
    waiter.join(timeout=30)
    assert verdict == {"a": None}


@pytest.mark.parametrize("storage", ["sqlite", "journal"])
def test_two_workers_starting_together_seed_the_study_once(tmp_path, monkeypatch, storage):
    """Two workers open one new study at once: both read it unseeded before either has seeded it
    (forced here: each waits at a barrier right after that read). Checking an attribute and then
    setting it let both seed: every pruned plan recorded twice and the estimator's picks enqueued
    twice. The seeding is claimed in the storage; exactly one worker seeds, the other waits for it."""
    import threading

    import optuna

    from helpers import Replay
    from zeroplan.tuner import TuneSettings, Tuner, make_sampler
    from zeroplan.tuner.ledger import ClaimsLedger
    from zeroplan.tuner.search import SEEDED_ATTR, initial_candidates

    space = _space_with_pruned_plans()
    url = storage_url(None if storage == "sqlite" else str(tmp_path / "study.journal"), tmp_path)
    open_study(url, resume=False, sampler=None)
    studies = [optuna.load_study(storage=open_storage(url), study_name="zeroplan", sampler=make_sampler("tpe", seed=0)) for _ in range(2)]
    settings = TuneSettings(trials=4, n_initial=3)
    tuners = [Tuner(study, space, Replay(), settings) for study in studies]
    for i, tuner in enumerate(tuners):  # two processes' ledgers (Tuner takes this process's host:pid)
        tuner.ledger.worker = f"{tuner.ledger.worker}-{i}"
    both_read = threading.Barrier(2, timeout=20)
    first_read = threading.local()
    read = ClaimsLedger.study_attr

    def read_then_meet(self, name):
        value = read(self, name)
        if name == SEEDED_ATTR and not getattr(first_read, "done", False):
            first_read.done = True
            both_read.wait()  # neither goes on until both have seen the study unseeded
        return value

    monkeypatch.setattr(ClaimsLedger, "study_attr", read_then_meet)
    messages: dict[int, list[str]] = {}
    errors: list[BaseException] = []

    def prepare(i: int) -> None:
        try:
            messages[i] = tuners[i].prepare(resume=True)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=prepare, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    trials = studies[0].get_trials()
    pruned = [t.user_attrs["plan_key"] for t in trials if t.state.name == "PRUNED" and t.user_attrs.get("source") == "estimator"]
    waiting = [t.params for t in trials if t.state.name == "WAITING"]
    assert sorted(pruned) == sorted(c.key for c in space.pruned), f"pruned plans recorded {len(pruned)} times for {len(space.pruned)}"
    assert len(waiting) == len(initial_candidates(space, settings.initial)), f"{len(waiting)} picks enqueued"
    seeded = [i for i, m in messages.items() if any(x.startswith("new study:") for x in m)]
    assert len(seeded) == 1 and any(x.startswith("study seeded by worker") for x in messages[1 - seeded[0]]), messages
    assert studies[1].user_attrs[SEEDED_ATTR] is True


def _space_with_pruned_plans():
    """Llama-2-7B on 2 A100-80GB: the estimator rules out the plans that keep every state on the GPUs."""
    from zeroplan.profiles import resolve_cluster, resolve_model
    from zeroplan.spec import TrainingSpec
    from zeroplan.tuner import build_space

    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=1024, nvme_gib=None)
    space = build_space(resolve_model(None, "llama-2-7b"), cluster, TrainingSpec(seq_len=1024, global_batch=8))
    assert space.pruned and space.fitting
    return space
