"""The tuner's bookkeeping on real Optuna storages (SQLite, journal file), without probes.

The runner here replays probe outcomes chosen by the test (ok with a throughput, oom, a crash),
so each test checks what the tuner does with them: no plan probed twice, OOM pruning, crash
recovery and retry, several worker processes on one storage, storage faults as one-line errors.
Real probes run in tests/test_tuner_cli.py.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from zeroplan.spec import Plan
from zeroplan.tuner import ProbeOutcome, StorageError, TuneSettings, Tuner, make_sampler, open_study, storage_url
from zeroplan.tuner.ledger import remeasurements, trial_reason, trial_status
from zeroplan.tuner.results import CSV_COLUMNS, write_results
from zeroplan.tuner.storage import open_storage

from helpers import ROOT, Replay, make_space, zeroplan_env


def new_tuner(tmp_path: Path, runner, *, trials: int, resume: bool = False, storage: str | None = None, **kw) -> Tuner:
    study = open_study(storage_url(storage, tmp_path), resume=resume, sampler=make_sampler("tpe", seed=1))
    tuner = Tuner(study, make_space(), runner, TuneSettings(trials=trials, **kw))
    tuner.prepare(resume=resume)
    return tuner


def search_storage(tmp_path: Path) -> str:
    """The journal file storage, for the tests of the search itself (which plans, in what order,
    what is pruned): the same Optuna API as the SQLite default at a fifth of its CPU (measured:
    2.2 s against 10.5 s for test_oom_prunes_larger_micro_batches), since every trial's bookkeeping
    is a few SQLAlchemy ORM commits. SQLite keeps the tests of resuming, workers, locks and results."""
    return str(tmp_path / "study.journal")


def probed_keys(tuner: Tuner) -> list[str]:
    return [t.user_attrs["plan_key"] for t in tuner.study.get_trials() if t.user_attrs.get("status") in ("ok", "oom", "error", "timeout")]


def test_estimator_picks_come_first_then_no_plan_twice(tmp_path):
    runner = Replay(oom_from=None)
    tuner = new_tuner(tmp_path, runner, trials=10, n_initial=3, storage=search_storage(tmp_path))
    summary = tuner.run()
    keys = probed_keys(tuner)
    assert len(keys) == 10 == summary.probes_in_study == summary.probes_this_run
    assert len(set(keys)) == 10
    space = tuner.space
    first = [t.user_attrs["plan_key"] for t in tuner.study.get_trials()[:3]]
    assert first[0] == space.fitting[0].key
    assert {t.user_attrs["source"] for t in tuner.study.get_trials()[:3]} == {"estimator"}
    best = tuner.best()
    assert best.value == max(t.value for t in tuner.study.get_trials() if t.value is not None)


def test_exhausts_a_small_space_exactly_once(tmp_path):
    runner = Replay(oom_from=None)
    study = open_study(storage_url(search_storage(tmp_path), tmp_path), resume=False, sampler=make_sampler("random", seed=0))
    space = make_space(global_batch=2)  # micro-batch 1 only: 18 plans
    tuner = Tuner(study, space, runner, TuneSettings(trials=100))
    tuner.prepare(resume=False)
    summary = tuner.run()
    assert summary.stopped_because == "space exhausted"
    assert Counter(probed_keys(tuner)) == Counter(c.key for c in space.fitting)


def test_oom_prunes_larger_micro_batches(tmp_path):
    runner = Replay(oom_from=4)
    study = open_study(storage_url(search_storage(tmp_path), tmp_path), resume=False, sampler=make_sampler("random", seed=0))
    space = make_space(global_batch=8)  # micro-batches 1, 2, 4
    tuner = Tuner(study, space, runner, TuneSettings(trials=100, n_initial=0))
    tuner.prepare(resume=False)
    tuner.run()
    ooms = [p for p in runner.calls if p.stage == 0 and p.micro_batch >= 4]
    assert ooms, "the search never probed an OOM'ing plan"
    first = ooms[0]
    for p in runner.calls[runner.calls.index(first) + 1:]:
        # Nothing at stage 0 that needs at least as much memory is probed after the OOM.
        assert not (p.stage == 0 and p.micro_batch >= first.micro_batch and (first.checkpointing == "full" or p.checkpointing == "none"))
    reasons = [t.user_attrs.get("reason", "") for t in study.get_trials() if t.state.name == "PRUNED"]
    assert any(r.startswith("larger than an OOM'd micro-batch") for r in reasons)
    oom_trials = [t for t in study.get_trials() if t.user_attrs.get("status") == "oom"]
    # Visible to TPE (it ignores FAIL trials): PRUNED with the oom constraint violated.
    assert oom_trials and all(t.state.name == "PRUNED" and t.constraints == {"oom": 1.0} for t in oom_trials)


def test_runner_exception_is_a_failed_trial_and_search_goes_on(tmp_path):
    space = make_space()
    crash = space.fitting[0].key
    tuner = new_tuner(tmp_path, Replay(oom_from=None, crash_keys=(crash,)), trials=3)
    tuner.run()
    trials = tuner.study.get_trials()
    bad = [t for t in trials if t.user_attrs.get("plan_key") == crash and t.user_attrs.get("status") == "error"]
    assert len(bad) == 1 and bad[0].state.name == "PRUNED" and bad[0].constraints == {"failure": 1.0}
    assert "RuntimeError: runner exploded" in bad[0].user_attrs["reason"]
    assert len(probed_keys(tuner)) == 3


def test_keyboard_interrupt_then_resume_retries_the_plan(tmp_path):
    space = make_space()
    target = space.fitting[1].key

    class Interrupting(Replay):
        def __call__(self, plan, **kw):
            from zeroplan.tuner import plan_key

            if plan_key(plan) == target and not getattr(self, "fired", False):
                self.fired = True
                raise KeyboardInterrupt
            return super().__call__(plan, **kw)

    runner = Interrupting(oom_from=None)
    tuner = new_tuner(tmp_path, runner, trials=4)
    with pytest.raises(KeyboardInterrupt):
        tuner.run()
    t = [t for t in tuner.study.get_trials() if t.user_attrs.get("plan_key") == target][0]
    assert t.state.name == "FAIL" and t.user_attrs["status"] == "interrupted"
    done_before = probed_keys(tuner)

    resumed = new_tuner(tmp_path, runner, trials=4, resume=True)
    resumed.run()
    keys = probed_keys(resumed)
    assert keys[: len(done_before)] == done_before  # nothing lost
    assert len(keys) == len(set(keys)) == 4  # nothing duplicated
    assert target in keys  # the interrupted plan was retried
    retry = [t for t in resumed.study.get_trials() if t.user_attrs.get("source") == "retry"]
    assert retry and retry[0].user_attrs["plan_key"] == target


def test_resume_fails_running_trials_of_dead_workers(tmp_path):
    tuner = new_tuner(tmp_path, Replay(oom_from=None), trials=2)
    tuner.run()
    # A worker that claimed a plan and died (its pid no longer exists on this host).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    cand = next(c for c in tuner.space.fitting if c.key not in probed_keys(tuner))
    tuner.study.enqueue_trial(cand.params)
    trial = tuner.study.ask()
    assert tuner._suggest(trial) == cand.params
    for k, v in {"plan_key": cand.key, "worker": f"{tuner.worker.rsplit(':', 1)[0]}:{dead_pid}", "deadline_unix": 9e99}.items():
        trial.set_user_attr(k, v)
    stale_number = trial.number

    resumed = new_tuner(tmp_path, Replay(oom_from=None), trials=4, resume=True)
    t = resumed.study.get_trials()[stale_number]
    # Failed by number (public API); its status is derived, as trials.csv shows it.
    assert t.state.name == "FAIL" and trial_status(t) == "interrupted"
    assert trial_reason(t) == f"worker {tuner.worker.rsplit(':', 1)[0]}:{dead_pid} stopped during the trial"
    resumed.run()
    assert len(set(probed_keys(resumed))) == len(probed_keys(resumed)) == 4
    assert cand.key in probed_keys(resumed)  # the dead worker's plan was retried


def test_new_run_refuses_an_existing_study_without_resume(tmp_path):
    new_tuner(tmp_path, Replay(), trials=1).run()
    with pytest.raises(StorageError, match="--resume"):
        open_study(storage_url(None, tmp_path), resume=False, sampler=None)


def test_different_space_is_refused_on_resume(tmp_path):
    new_tuner(tmp_path, Replay(), trials=1).run()
    study = open_study(storage_url(None, tmp_path), resume=True, sampler=None)
    other = Tuner(study, make_space(global_batch=32), Replay(), TuneSettings(trials=2))
    with pytest.raises(StorageError, match="different model, batch or search space"):
        other.prepare(resume=True)


def test_journal_file_storage(tmp_path):
    journal = tmp_path / "study.journal"
    tuner = new_tuner(tmp_path, Replay(oom_from=None), trials=3, storage=str(journal))
    tuner.run()
    assert journal.exists()
    again = new_tuner(tmp_path, Replay(oom_from=None), trials=5, storage=str(journal), resume=True)
    again.run()
    assert len(set(probed_keys(again))) == 5


def test_corrupt_storage_is_one_line(tmp_path):
    bad_db = tmp_path / "study.db"
    bad_db.write_bytes(b"definitely not sqlite " * 200)
    with pytest.raises(StorageError, match="corrupt") as err:
        open_storage(storage_url(None, tmp_path))
    assert "\n" not in str(err.value)
    bad_journal = tmp_path / "j.log"
    # Optuna forgives a torn last line (a write cut short); a damaged line before it is corruption.
    bad_journal.write_text("{not json\n" + json.dumps({"op_code": 0, "worker_id": "w", "study_name": "s"}) + "\n")
    with pytest.raises(StorageError, match="journal file cannot be read"):
        open_storage(storage_url(str(bad_journal), tmp_path))


def test_locked_storage_is_one_line(tmp_path):
    url = storage_url(None, tmp_path)
    open_study(url, resume=False, sampler=None)  # create the schema
    holder = sqlite3.connect(tmp_path / "study.db", isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StorageError, match="locked") as err:
            study = open_study(url, resume=True, sampler=None, lock_timeout_s=0.5)
            study.enqueue_trial({"zero": "z0"})
        assert "\n" not in str(err.value)
    finally:
        holder.execute("ROLLBACK")
        holder.close()


WORKER = textwrap.dedent(
    """
    import sys, time
    from helpers import Replay, make_space
    from zeroplan.tuner import TuneSettings, Tuner, make_sampler, open_study

    class Slow(Replay):
        def __call__(self, plan, **kw):
            time.sleep(0.3)
            return super().__call__(plan, **kw)

    study = open_study({url!r}, resume=True, sampler=make_sampler("tpe"))
    tuner = Tuner(study, make_space(), Slow(oom_from=None), TuneSettings(trials=12, n_initial=6))
    tuner.prepare(resume=True)
    # Start searching together (a loaded machine may start one interpreter seconds after the other).
    import os, pathlib
    barrier = pathlib.Path({barrier!r})
    (barrier / str(os.getpid())).touch()
    deadline = time.monotonic() + 120
    while len(list(barrier.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    print(tuner.run().probes_this_run)
    """
)


def test_two_worker_processes_share_one_study(tmp_path):
    url = storage_url(None, tmp_path)
    (tmp_path / "barrier").mkdir()
    code = WORKER.format(url=url, barrier=str(tmp_path / "barrier"))
    env = zeroplan_env(PYTHONPATH=f"{ROOT}{__import__('os').pathsep}{ROOT / 'tests'}")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    per_worker = [int(out.strip().splitlines()[-1]) for out, _ in outs]
    study = open_study(url, resume=True, sampler=None)
    keys = [t.user_attrs["plan_key"] for t in study.get_trials() if t.user_attrs.get("status") == "ok"]
    assert len(keys) == len(set(keys)), "a plan was probed twice"
    assert len(keys) == sum(per_worker) == 12
    workers = {t.user_attrs["worker"] for t in study.get_trials() if t.user_attrs.get("status") == "ok"}
    assert len(workers) == 2, "both workers should have probed"
    assert not [t for t in study.get_trials() if t.state.name == "RUNNING"]


def test_results_files(tmp_path):
    tuner = new_tuner(tmp_path, Replay(oom_from=4), trials=6)
    tuner.run()
    frame = write_results(tuner.study.get_trials(), tmp_path, {"script": "x.py", "plans": 72, "pruned": 0})
    import pandas as pd

    csv = pd.read_csv(tmp_path / "trials.csv")
    assert list(csv.columns) == CSV_COLUMNS
    assert len(csv) == len([t for t in tuner.study.get_trials() if t.state.name != "WAITING"])
    best = tuner.best()
    assert json.loads((tmp_path / "ds_config.json").read_text()) == best.user_attrs["ds_config"]
    report = (tmp_path / "report.md").read_text()
    assert f"**Best plan: `{best.user_attrs['plan_key']}`**" in report
    assert (tmp_path / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert frame["measured_samples_per_second"].max() == pytest.approx(best.value)


def test_time_budget_stops_new_probes(tmp_path):
    import time as _time

    class Slow(Replay):
        def __call__(self, plan, **kw):
            _time.sleep(1.2)
            return super().__call__(plan, **kw)

    # Seconds, not tenths: the search's own start can take most of a second on a loaded machine.
    tuner = new_tuner(tmp_path, Slow(oom_from=None), trials=50, time_budget_s=3.0)
    summary = tuner.run()
    assert summary.stopped_because == "time budget"
    # Probes start only while the budget lasts: at most ceil(3.0 / 1.2) of them.
    assert 1 <= summary.probes_this_run <= 3


class OomAtStageZero:
    """What a CPU probe of benchmarks/faulty_train.py --oom-stage 0 --oom-micro-batch 8 reports: an
    OOM at stage 0 with micro-batch >= 8 (labelled ``host``: CPU ranks have no device allocator),
    every other plan works."""

    def __init__(self, oom_from: int = 8):
        self.calls: list[Plan] = []
        self.oom_from = oom_from

    def __call__(self, plan: Plan, *, trial_number: int, on_line=None) -> ProbeOutcome:
        self.calls.append(plan)
        if plan.stage == 0 and plan.micro_batch >= self.oom_from:
            return ProbeOutcome(status="oom", error="OutOfMemoryError: CUDA out of memory", memory_limit="host")
        return ProbeOutcome(status="ok", samples_per_second=float(plan.micro_batch) + plan.stage, peak_memory_bytes=1000, ds_config={"s": plan.stage})


def test_first_probe_oom_goes_on_to_plans_that_need_less(tmp_path):
    space = make_space(global_batch=16)
    # The opening probe is the OOM'ing plan, as in the tune that stopped after it.
    space.candidates[:] = sorted(space.candidates, key=lambda c: (not c.fits, (c.plan.stage, c.plan.micro_batch) != (0, 8)))
    runner = OomAtStageZero()
    study = open_study(storage_url(None, tmp_path), resume=False, sampler=make_sampler("tpe", seed=1))
    tuner = Tuner(study, space, runner, TuneSettings(trials=8, n_initial=4))
    tuner.prepare(resume=False)
    summary = tuner.run()
    assert (runner.calls[0].stage, runner.calls[0].micro_batch) == (0, 8)
    assert summary.stopped_because == "trials reached" and summary.probes_this_run == 8
    assert summary.best_value is not None and summary.best_value > 0
    # Nothing at stage 0 needing at least the OOM'd plan's memory was probed after it; other stages were.
    later = runner.calls[1:]
    assert not any(p.stage == 0 and p.micro_batch >= 8 and p.checkpointing == "none" for p in later)
    assert {p.stage for p in later} - {0}
    # The estimator's enqueued picks were probed or released with a reason: none left waiting.
    assert not [t for t in study.get_trials() if t.state.name == "WAITING"]


def test_space_exhausted_releases_enqueued_picks(tmp_path):
    space = make_space(global_batch=4)  # micro-batches 1 and 2: 36 plans
    space.candidates[:] = sorted(space.candidates, key=lambda c: (not c.fits, (c.plan.stage, c.plan.micro_batch) != (0, 2)))
    study = open_study(storage_url(search_storage(tmp_path), tmp_path), resume=False, sampler=make_sampler("random", seed=1))
    tuner = Tuner(study, space, OomAtStageZero(oom_from=2), TuneSettings(trials=200, n_initial=4))
    tuner.prepare(resume=False)
    summary = tuner.run()
    assert summary.stopped_because == "space exhausted"
    assert not [t for t in study.get_trials() if t.state.name == "WAITING"]
    # Every plan that does not need the OOM'd plan's memory was probed.
    probed = set(probed_keys(tuner))
    assert all(c.key in probed for c in space.fitting if not (c.plan.stage == 0 and c.plan.micro_batch >= 2))


def test_a_probe_without_throughput_is_never_ranked(tmp_path):
    class NoStepTime(Replay):
        def __call__(self, plan, **kw):
            out = super().__call__(plan, **kw)
            return ProbeOutcome(status="ok", samples_per_second=0.0, ds_config={}) if plan.gradient_accumulation_steps > 1 else out

    tuner = new_tuner(tmp_path, NoStepTime(oom_from=None), trials=12, storage=search_storage(tmp_path))
    tuner.run()
    trials = tuner.study.get_trials()
    unmeasured = [t for t in trials if t.user_attrs.get("plan", {}).get("gradient_accumulation_steps", 1) > 1 and t.user_attrs.get("probed")]
    assert unmeasured, "no accumulation plan was probed"
    assert all(t.user_attrs["status"] == "error" and t.value is None and "measured no step time" in t.user_attrs["reason"] for t in unmeasured)
    frame = write_results(trials, tmp_path, {"script": "x.py", "plans": 72, "pruned": 0})
    ok = frame[frame["status"] == "ok"]
    assert (ok["measured_samples_per_second"].astype(float) > 0).all()
    assert tuner.best().user_attrs["plan"]["gradient_accumulation_steps"] == 1


def test_top_plans_are_measured_again_before_the_best_is_named(tmp_path):
    """Two plans; the first measured 10 then 6 samples/s (its two readings 67 % apart, so it is
    measured a third time: 7), the second 9 and 9: the best is the second (median 9 > 7), and the
    ranking is said not to hold (the gap, 29 %, is within one plan's repeat spread, 57 %)."""
    space = make_space(global_batch=2)
    series = [[10.0, 6.0, 7.0], [9.0, 9.0]]  # the first plan probed, the second
    values: dict[str, list[float]] = {}
    calls: list[str] = []

    def runner(plan, *, trial_number, on_line=None):
        from zeroplan.tuner import plan_key

        key = plan_key(plan)
        calls.append(key)
        if key not in values:
            values[key] = series[len(values)]
        measured = values[key]
        return ProbeOutcome(status="ok", samples_per_second=measured.pop(0), peak_memory_bytes=1, ds_config={"k": key})

    study = open_study(storage_url(None, tmp_path), resume=False, sampler=make_sampler("tpe", seed=1))
    tuner = Tuner(study, space, runner, TuneSettings(trials=2, n_initial=2))
    tuner.prepare(resume=False)
    summary = tuner.run()
    first, second = calls[:2]
    assert calls == [first, second, second, first, first]  # re-measured in reverse order; the first's readings disagree: once more
    assert summary.best_plan_key == second and summary.best_value == 9.0
    trust = summary.trust
    assert (trust.best_key, trust.runner_up_key) == (second, first)
    assert trust.gap == pytest.approx(9 / 7 - 1) and trust.repeat_spread == pytest.approx(4 / 7) and not trust.firm
    assert "not told apart at this load" in trust.text
    from zeroplan.tuner.search import remeasurements

    frame = write_results(study.get_trials(), tmp_path, {"script": "x.py", "plans": 18, "pruned": 0}, remeasured=remeasurements(study.user_attrs))
    assert json.loads((tmp_path / "ds_config.json").read_text()) == {"k": second}
    ranked = dict(zip(frame["plan"], frame["ranked_samples_per_second"]))
    assert ranked[first] == 7.0 and ranked[second] == 9.0


@pytest.mark.parametrize("readings, third", [([10.0, 9.2], False), ([10.0, 8.9], True), ([8.0, 10.0], True)])
def test_a_third_reading_only_where_two_disagree_by_more_than_ten_percent(tmp_path, readings, third):
    """A top plan whose two readings are within :data:`SETTLE` (10 %) of each other is not probed
    again; one whose readings differ by more is, once, and ranked by the median of the three."""
    from zeroplan.tuner import plan_key
    from zeroplan.tuner.search import SETTLE

    assert SETTLE == 0.10
    space = make_space(global_batch=2)
    values: dict[str, list[float]] = {}
    calls: list[str] = []

    def runner(plan, *, trial_number, on_line=None):
        key = plan_key(plan)
        calls.append(key)
        series = values.setdefault(key, [*readings, 9.5] if not values else [5.0, 5.0, 5.0])
        return ProbeOutcome(status="ok", samples_per_second=series.pop(0), peak_memory_bytes=1, ds_config={})

    study = open_study(storage_url(None, tmp_path), resume=False, sampler=make_sampler("tpe", seed=1))
    tuner = Tuner(study, space, runner, TuneSettings(trials=2, n_initial=2))
    tuner.prepare(resume=False)
    summary = tuner.run()
    best = summary.best_plan_key
    assert calls.count(best) == (3 if third else 2)
    assert summary.best_value == pytest.approx(sorted([*readings, 9.5])[1] if third else sum(readings) / 2)
    assert calls.count(next(k for k in values if k != best)) == 2  # 5.0 twice: agrees with itself


def test_workers_sharing_a_study_keep_each_others_remeasurements(tmp_path):
    """Two workers re-measure the same two plans in one SQLite study, the second while the first is
    still measuring: every re-measurement of both stays in the study (one read-modify-written
    attribute kept only the last writer's)."""
    space = make_space(global_batch=2)
    url = storage_url(None, tmp_path)
    base = {}

    def make_runner(step: float, during=None):
        def runner(plan, *, trial_number, on_line=None):
            from zeroplan.tuner import plan_key

            key = plan_key(plan)
            if key not in base:
                base[key] = 10.0 - len(base)
                return ProbeOutcome(status="ok", samples_per_second=base[key], peak_memory_bytes=1, ds_config={})
            if during is not None and during:
                during.pop()()  # the other worker re-measures while this one measures
            return ProbeOutcome(status="ok", samples_per_second=base[key] + step, peak_memory_bytes=1, ds_config={})

        return runner

    first_study = open_study(url, resume=False, sampler=make_sampler("tpe", seed=1))
    first = Tuner(first_study, space, make_runner(0.5), TuneSettings(trials=2, n_initial=2))
    first.prepare(resume=False)
    first.run()  # probes two plans, re-measures both (+0.5)
    second = Tuner(open_study(url, resume=True, sampler=make_sampler("tpe", seed=1)), space, make_runner(0.25), TuneSettings(trials=2, n_initial=2))
    third = Tuner(open_study(url, resume=True, sampler=make_sampler("tpe", seed=1)), space, make_runner(0.75, during=[second.remeasure]),
                  TuneSettings(trials=2, n_initial=2))
    third.remeasure()
    again = remeasurements(first_study.user_attrs)
    assert sorted(again) == sorted(base)
    for key, value in base.items():
        assert sorted(again[key]) == [value + 0.25, value + 0.5, value + 0.75], again
    assert third.measurements(next(t for t in first_study.trials if t.user_attrs.get("plan_key") == key)) == [value, *again[key]]


def test_trust_line_says_when_the_plans_work_repeats_but_the_wall_time_does_not():
    """At load the same plan's wall time may differ by 90% while the CPU its rank used per step
    differs by 10% (runtime.rank.threads: one thread per CPU rank): the line says both."""
    from zeroplan.tuner.settings import Trust

    loaded = Trust(best_key="a", runner_up_key="b", gap=0.12, repeat_spread=0.93, load_1m=(15.0, 17.0), cores=2, cpu_repeat_spread=0.1)
    assert not loaded.firm
    assert "differs by up to 93%, its CPU time per step by up to 10% (load 15.0–17.0 on 2 cores)" in loaded.text
    assert "their wall time is their share of cores other jobs use" in loaded.text
    noisy = Trust(best_key="a", runner_up_key="b", gap=0.12, repeat_spread=0.93, load_1m=(1.0, 1.0), cores=2, cpu_repeat_spread=0.8)
    assert "share of cores" not in noisy.text and "not told apart" in noisy.text
    gpu = Trust(best_key="a", runner_up_key="b", gap=0.3, repeat_spread=0.05, load_1m=(0.1, 0.2), cores=8)
    assert gpu.firm and "CPU time" not in gpu.text


@pytest.mark.timeout(120)
def test_a_layout_only_space_is_searched_not_rejected_for_ever(tmp_path):
    """``tune --tp 2`` (or ``--sp 2``, ``--ep 2``): every plan has a layout, so each trial must carry
    it. Sampled parameters without it named data-parallel plans the space never enumerated, and the
    loop rejected every trial without end."""
    from zeroplan.profiles import resolve_cluster
    from zeroplan.spec import TrainingSpec
    from zeroplan.tuner import build_space

    from helpers import GPT_TASK

    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    space = build_space(GPT_TASK, cluster, TrainingSpec(seq_len=64, global_batch=2), device="cpu", tp=(2,), stages=(0, 1))
    assert space.layout_choices == ["tp2"] and space.fitting
    runner = Replay(oom_from=None)
    study = open_study(storage_url(None, tmp_path), resume=False, sampler=make_sampler("random", seed=0))
    tuner = Tuner(study, space, runner, TuneSettings(trials=3, n_initial=1))
    tuner.prepare(resume=False)
    tuner.run()
    # 3 trials, then the re-measurements of the two best: every probe at tp 2.
    assert len(runner.calls) >= 3 and all(p.tp == 2 for p in runner.calls)
    # trials.csv carries the layout's degrees beside the plan's other fields.
    import pandas as pd

    write_results(tuner.study.get_trials(), tmp_path, {"script": "x.py", "plans": len(space.candidates), "pruned": 0})
    csv = pd.read_csv(tmp_path / "trials.csv", dtype=str)
    probed = csv[csv.status == "ok"]
    # Whole numbers, as the stage's column.
    assert len(probed) >= 3 and set(probed.tp) == {"2"} and set(probed.sp) == {"1"} and set(probed.ep) == {"1"}
    assert all("tp2" in label for label in probed.plan)
    # report.md says what the script must do for the layout the probes ran on its behalf.
    assert "tensor parallelism (tp 2): DeepSpeed's AutoTP shards the model" in (tmp_path / "report.md").read_text()
