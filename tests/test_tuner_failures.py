"""Failure signatures and the regions they rule out (zeroplan.tuner.failures), on real error text
and the worker's own progress lines, then through the search loop on a real SQLite study."""

from __future__ import annotations

import pytest
import torch

from zeroplan.runtime.measure.classify import classify
from zeroplan.runtime.rank.worker import ProbeDone, StepMeter
from zeroplan.tuner import ProbeOutcome, TuneSettings, Tuner, make_sampler, open_study, plan_key, storage_url
from zeroplan.tuner.failures import classify_failure, learned_regions, normalise_error, progress_from_lines

from helpers import make_space


def _torch_error(a: tuple[int, int], b: tuple[int, int]) -> str:
    try:
        torch.ones(*a) @ torch.ones(*b)
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    raise AssertionError("no error")


def _rank_error(rank: int, text: str) -> str:
    """The error line the runtime reports for a rank that failed (zeroplan.runtime.measure.classify)."""
    status, reason = classify(returncode=1, timed_out=False, timeout_s=60, ranks=[{"rank": rank, "status": "error", "error": text}], expected_ranks=2, log_text="")
    assert status == "error"
    return reason


def test_one_bug_one_signature_across_ranks_shapes_and_paths():
    a = _rank_error(0, _torch_error((3, 4), (5, 6)) + " in /tmp/probe-1/trial-0003/x.py at 0x7f3a9c")
    b = _rank_error(1, _torch_error((8, 16), (32, 8)) + " in /home/u/run/trial-0007/x.py at 0x55d1e0")
    assert a != b
    assert normalise_error(a) == normalise_error(b) == "RuntimeError: mat1 and mat2 shapes cannot be multiplied (NxN and NxN) in <path> at <addr>"
    other = _rank_error(0, "AssertionError: ZeRO-3 is not supported here")
    assert normalise_error(other) != normalise_error(a)


def _progress(warmup: int, steps: int, fail_at: int | None) -> list[str]:
    """The progress lines a real StepMeter prints (rank 0) until a failure at optimizer step ``fail_at``."""
    lines: list[str] = []
    meter = StepMeter(warmup=warmup, steps=steps, report=lambda e: lines.append(f"zeroplan-progress {e} t=0.5"))
    meter.start()
    try:
        for step in range(warmup + steps):
            if fail_at is not None and step == fail_at:
                break
            meter.optimizer_step_done()
    except ProbeDone:
        pass
    return lines


@pytest.mark.parametrize(
    ("status", "lines", "kind", "phase"),
    [
        ("error", [], "crash", "start-up"),
        ("error", "first", "crash", "first step"),
        ("error", "third", "crash", "steps"),
        ("timeout", "first", "hang", "first step"),
        ("timeout", "third", "hang", "steps"),
        ("oom", "first", "oom-host", "first step"),
    ],
)
def test_kind_and_phase_from_the_workers_progress_lines(status, lines, kind, phase):
    fail_at = {"first": 0, "third": 2}.get(lines) if lines else None
    progress = _progress(1, 5, fail_at) if lines else []
    ready, steps, _ = progress_from_lines(["unrelated line", *progress])
    error = {"error": "rank 0: ValueError: boom", "timeout": "no result within 60 s", "oom": "rank 1: DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes"}[status]
    failure = classify_failure(status, error, engine_ready=ready is not None, optimizer_steps=steps)
    assert (failure.kind, failure.phase) == (kind, phase)
    assert failure.signature.startswith(f"{kind}/{phase}")


def test_engine_assertion_and_device_oom():
    f = classify_failure("error", "rank 0: AssertionError: shapes differ 12 vs 14", engine_ready=True, optimizer_steps=0)
    assert f.kind == "assertion" and f.signature == "assertion/first step: AssertionError: shapes differ N vs N"
    f = classify_failure("oom", "rank 0: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", engine_ready=None, optimizer_steps=0)
    assert (f.kind, f.phase) == ("oom-device", None)
    assert classify_failure("ok", "", engine_ready=True, optimizer_steps=7) is None


class Faulty:
    """Replays the script of the issue: ZeRO-3 crashes at start-up, micro-batch >= 16 hangs in the
    first step, everything else works (faster with larger micro-batches)."""

    def __init__(self, *, everything_crashes: bool = False):
        self.calls = []
        self.everything_crashes = everything_crashes

    def __call__(self, plan, *, trial_number, on_line=None):
        self.calls.append(plan)
        if self.everything_crashes:
            return ProbeOutcome(status="error", error=f"rank {trial_number % 2}: ImportError: cannot import name 'foo' from /tmp/{trial_number}/m.py", engine_ready=False)
        if plan.stage == 3:
            return ProbeOutcome(status="error", error="rank 0: RuntimeError: stage 3 broke at 0x7f00", engine_ready=False)
        if plan.micro_batch >= 16:
            return ProbeOutcome(status="timeout", error="no result within 60 s", engine_ready=True, optimizer_steps=0)
        return ProbeOutcome(status="ok", samples_per_second=plan.micro_batch * (1.0 - 0.1 * plan.stage), engine_ready=True, optimizer_steps=7)


def _run(tmp_path, runner, trials):
    # A journal file storage: the search is the same as on the SQLite default at a fraction of the
    # CPU (SQLAlchemy's ORM per trial); test_tuner_search keeps SQLite's own tests.
    study = open_study(storage_url(str(tmp_path / "study.journal"), tmp_path), resume=False, sampler=make_sampler("tpe", seed=3))
    tuner = Tuner(study, make_space(global_batch=32), runner, TuneSettings(trials=trials))
    tuner.prepare(resume=False)
    return tuner, tuner.run()


def test_failing_regions_are_probed_at_most_twice_and_a_working_plan_wins(tmp_path):
    runner = Faulty()
    tuner, summary = _run(tmp_path, runner, trials=10)
    assert sum(p.stage == 3 for p in runner.calls) <= 2
    assert sum(p.micro_batch >= 16 for p in runner.calls) <= 2
    assert summary.best_value is not None and summary.best_plan_key is not None
    # The search probes no plan twice; after it, the two best are measured once more.
    search = runner.calls[: summary.probes_this_run]
    assert len({plan_key(p) for p in search}) == len(search)
    assert len(runner.calls) == summary.probes_this_run + 2
    assert {plan_key(p) for p in runner.calls[summary.probes_this_run:]} <= {plan_key(p) for p in search}


def _pick(space, **want):
    return next(c for c in space.fitting if all(getattr(c.plan, k) == v for k, v in want.items()))


def test_regions_from_two_failures_with_one_signature():
    space = make_space(global_batch=32)
    startup = classify_failure("error", "rank 0: RuntimeError: stage 3 broke", engine_ready=False, optimizer_steps=0)
    a = (1, _pick(space, stage=3, offload_optimizer="none", micro_batch=4), startup)
    b = (4, _pick(space, stage=3, offload_optimizer="cpu", micro_batch=1), startup)
    region = learned_regions([a, b], successes=[])[0]
    # A start-up crash does not depend on the micro-batch, and "none" offloads are not suspects:
    # the whole stage goes, parameter offload and every micro-batch included.
    assert (region.stage, region.offload_optimizer, region.offload_param, region.min_micro_batch) == (3, None, None, None)
    assert region.contains(_pick(space, stage=3, offload_param="cpu", micro_batch=16))
    assert not region.contains(_pick(space, stage=2, micro_batch=1))
    assert region.reason == "region fails (ZeRO-3): crash/start-up: RuntimeError: stage N broke in trials #1 and #4"

    hang = classify_failure("timeout", "", engine_ready=True, optimizer_steps=0)
    h1 = (2, _pick(space, stage=1, offload_optimizer="none", micro_batch=16), hang)
    h2 = (5, _pick(space, stage=2, offload_optimizer="none", micro_batch=16), hang)
    region = learned_regions([h1, h2], successes=[])[0]
    assert region.description == "micro-batch ≥ 16"
    assert region.contains(_pick(space, stage=0, micro_batch=16)) and not region.contains(_pick(space, stage=0, micro_batch=8))
    # A plan that worked inside the region refutes it; another signature teaches nothing.
    assert learned_regions([h1, h2], successes=[_pick(space, stage=0, micro_batch=16)]) == []
    assert learned_regions([a, h1], successes=[]) == []


def test_a_script_that_fails_every_plan_stops_after_two_probes(tmp_path):
    runner = Faulty(everything_crashes=True)
    _, summary = _run(tmp_path, runner, trials=10)
    assert summary.stopped_because == "every plan fails"
    assert len(runner.calls) == 2
    assert summary.failure_signature == "crash/start-up: ImportError: cannot import name 'foo' from <path>"
    assert "fix this error" in summary.failure_fix


def test_a_probe_cut_short_by_a_derived_timeout_while_stepping_is_slow_not_a_hang():
    slow = classify_failure("timeout", "no result within 41 s", engine_ready=True, optimizer_steps=3, cut_short=True)
    assert (slow.kind, slow.signature) == ("slow", "slow/steps")
    # At --timeout itself, or before any step, it is a hang.
    assert classify_failure("timeout", "", engine_ready=True, optimizer_steps=3, cut_short=False).kind == "hang"
    assert classify_failure("timeout", "", engine_ready=True, optimizer_steps=0, cut_short=True).kind == "hang"
    space = make_space(global_batch=32)
    a = (1, _pick(space, stage=1, micro_batch=2), slow)
    b = (2, _pick(space, stage=2, micro_batch=2), slow)
    assert learned_regions([a, b], successes=[]) == []  # slow plans teach nothing about others
