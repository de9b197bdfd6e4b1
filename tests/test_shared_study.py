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
