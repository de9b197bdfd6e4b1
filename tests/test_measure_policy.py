"""The number a probe reports for a plan measured again: the statistic of its timed steps and its stop
rule (``zeroplan.runtime.measure.steptime.PROBE_POLICY``), checked against recorded real series —
probes of the same plans repeated on this machine (tests/data/repeat_series.json, the half of
``benchmarks/results/repeat_series.json`` the policy was not chosen on; ``benchmarks/bench_repeat_measure.py``)."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from helpers import ROOT, benchmark
from zeroplan.runtime.measure.meter import ProbeDone, StepMeter
from zeroplan.runtime.measure.steptime import PROBE_POLICY, STATISTICS, MeasurePolicy, replay, step_statistic

SERIES = ROOT / "tests" / "data" / "repeat_series.json"
OLD = MeasurePolicy()  # mean, stop at --ci 0.1 after 1 to 5 measured steps


@pytest.fixture(scope="module")
def recorded() -> dict:
    return json.loads(SERIES.read_text())


def test_statistics_agree_with_numpy():
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 5, 8, 13):
        x = rng.lognormal(-2, 0.3, n).tolist()
        assert step_statistic(x, "mean") == pytest.approx(np.mean(x))
        assert step_statistic(x, "median") == pytest.approx(np.median(x))
        assert step_statistic(x, "p25") == pytest.approx(np.percentile(x, 25))  # numpy's default: linear interpolation
        assert step_statistic(x, "min") == min(x)
        k = int(0.2 * n)
        assert step_statistic(x, "trimmed") == pytest.approx(np.mean(np.sort(x)[k:n - k]))
    assert set(STATISTICS) == {"mean", "median", "trimmed", "p25", "min"}
    with pytest.raises(ValueError, match="statistic"):
        MeasurePolicy(statistic="mode")
    with pytest.raises(ValueError, match="min_steps"):
        MeasurePolicy(min_steps=6, max_steps=5)


class _Clock:
    """perf_counter/process_time of the meter, advanced only by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    process_time = monotonic = perf_counter


def _meter_on(series: dict, policy: MeasurePolicy, monkeypatch) -> tuple[float, int]:
    """Drive the runtime's meter with a recorded probe's micro-step times (after 2 warm-up steps of
    1 s micro-steps, as the real probe had) and return (its step time, recorded micro-steps it ran)."""
    import zeroplan.runtime.measure.meter as meter_module

    clock = _Clock()
    monkeypatch.setattr(meter_module, "time", clock)
    g = series["grad_accum"]
    meter = StepMeter(warmup=2, steps=policy.max_steps, target_ci=policy.target_ci, memory_steps=2, policy=policy)
    meter.grad_accum = g
    meter.start()
    for i in range(1, 2 * g + 1):  # warm-up
        clock.now += 1.0
        meter.micro_step_done(boundary=i % g == 0)
    micro, boundary = iter(series["micro_times"]), iter(series["boundary_times"])
    used = 0
    with pytest.raises(ProbeDone):
        while True:
            used += 1
            at_boundary = used % g == 0
            clock.now += next(boundary) if at_boundary else next(micro)
            meter.micro_step_done(boundary=at_boundary)
    return meter.as_dict()["step_time"], used


def test_the_meter_reports_what_replay_computes_on_recorded_series(recorded, monkeypatch):
    """``replay`` (what the benchmark evaluates) is what the worker's meter does: on every recorded
    kind of plan, old and new policy, the same step time after the same number of micro-steps."""
    for plan in sorted({p["plan"] for p in recorded["probes"]}):
        series = next(p for p in recorded["probes"] if p["plan"] == plan)
        g = series["grad_accum"]
        for policy in (OLD, PROBE_POLICY, MeasurePolicy("p25", 0.03, 3, 8, 2), MeasurePolicy("trimmed", 0.05, 2, 6, 1)):
            step, steps = replay(policy, series["micro_times"], series["boundary_times"], g)
            got, used = _meter_on(series, policy, monkeypatch)
            assert got == pytest.approx(step, rel=1e-9), (plan, policy)
            assert used == steps * g, (plan, policy)


def test_the_probe_policy_repeats_better_on_series_it_was_not_chosen_on(recorded):
    """On the held-out half of the recorded probes, in CPU seconds per micro-step (a one-thread rank's
    step time on a quiet machine; the wall time of these probes, at load 8–16 on 2 cores, is the
    machine's share, not the plan's): two probes of one plan disagree less under the probe policy
    than under the old one (median and 90th percentile of every pair), the plans rank as their CPU
    time per step does, no kind of plan is favoured more than 2 points beyond the old policy's
    tilt, and a probe measures at most twice the old policy's steps."""
    bench = benchmark("bench_repeat_measure")
    probes = [bench.as_cpu(p) for p in recorded["probes"] if p["ok"]]
    ref = bench.cpu_reference(probes)
    old, new = bench.evaluate(OLD, probes, ref), bench.evaluate(PROBE_POLICY, probes, ref)
    assert new["probes"] == old["probes"] == len(probes)
    assert new["median"] < old["median"] and new["p90"] < old["p90"], (old, new)
    assert new["same_rank"], new
    assert new["tilt"] <= old["tilt"] + 0.02, (old, new)
    assert new["steps"] <= 2 * old["steps"], (old, new)
    assert new["within10"] > old["within10"], (old, new)


def test_tune_defaults_are_the_probe_policy():
    """`tune`'s --steps and --ci defaults are the policy's most steps and target (the meter takes
    them from there), and a whole-step probe (`probe`, `--ci 0`) reports the same statistic."""
    import inspect

    from zeroplan.cli.tune import tune
    from zeroplan.tuner.request import TuneRequest

    params = inspect.signature(tune).parameters
    assert params["steps"].default == PROBE_POLICY.max_steps and params["ci"].default == PROBE_POLICY.target_ci
    fields = TuneRequest.__dataclass_fields__
    assert fields["steps"].default == PROBE_POLICY.max_steps and fields["ci"].default == PROBE_POLICY.target_ci
    meter = StepMeter(warmup=0, steps=4)
    meter.step_times = [0.30, 0.21, 0.25, 0.40]
    assert meter.as_dict()["step_time"] == step_statistic(meter.step_times, PROBE_POLICY.statistic)


def test_recorded_series_are_real_probes(recorded):
    """The fixture is what the benchmark recorded: whole series, the load of each probe, and CPU
    time per step beside wall time."""
    probes = recorded["probes"]
    assert {p["plan"] for p in probes} == {"z0/mb32/ga1", "z0/mb16/ga2", "z0/mb4/ga8"}
    for p in probes:
        assert len(p["boundary_times"]) == len(p["step_cpu_times"]) >= 12
        assert len(p["micro_times"]) == (p["grad_accum"] - 1) * len(p["boundary_times"])
        assert len(p["load_1m"]) == 2
    assert statistics.median(x for p in probes for x in p["boundary_times"]) > 0
