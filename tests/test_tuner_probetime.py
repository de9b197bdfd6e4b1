"""Short probes: the step time from micro-steps with its confidence interval, the worker's
micro-step meter, and per-probe timeouts learned from the probes that worked."""

from __future__ import annotations

import random
import statistics
import time

import pytest

from zeroplan.runtime.measure.steptime import estimate_step_time, t_quantile_975
from zeroplan.runtime.rank.worker import ProbeDone, StepMeter
from zeroplan.tuner.probetime import TIMEOUT_MARGIN, TIMEOUT_SLACK_S, ProbeTiming, probe_timeout
from helpers import ROOT


def test_t_quantiles_match_the_normal_limit_and_table_rows():
    assert t_quantile_975(1) == 12.706 and t_quantile_975(10) == 2.228
    assert t_quantile_975(35) == t_quantile_975(30) == 2.042  # next smaller row: conservative
    assert t_quantile_975(10_000) == pytest.approx(statistics.NormalDist().inv_cdf(0.975), abs=1e-3)


@pytest.mark.parametrize("grad_accum, n_steps", [(1, 4), (8, 1), (8, 2), (16, 1)])
def test_interval_covers_the_true_step_time_95_percent_of_the_time(grad_accum, n_steps):
    """Simulated micro-step times (normal, 8% spread; the boundary one also runs the optimizer):
    the 95% interval of T = (G−1)·m + b must hold the true T in about 95% of repetitions."""
    rng = random.Random(1234)
    m, b = 0.010, 0.025
    true_t = (grad_accum - 1) * m + b
    runs, hits = 2000, 0
    for _ in range(runs):
        micro = [rng.gauss(m, 0.08 * m) for _ in range((grad_accum - 1) * n_steps)]
        boundary = [rng.gauss(b, 0.08 * b) for _ in range(n_steps)]
        est = estimate_step_time(micro, boundary, grad_accum)
        hits += abs(est.step_time_s - true_t) <= est.half_width_s
    assert 0.93 <= hits / runs <= 0.985


def test_no_interval_before_enough_samples():
    assert estimate_step_time([0.1], [0.2], 8) is None
    assert estimate_step_time([], [0.2], 1) is None
    assert estimate_step_time([0.1, 0.1], [], 8) is None


def _drive(meter: StepMeter, accum: int, micro_s: float, boundary_s: float, limit: int = 200) -> int:
    """Run micro-steps through the meter (sleeping their duration) until it ends the run."""
    meter.grad_accum = accum
    meter.start()
    for i in range(1, limit + 1):
        boundary = i % accum == 0
        time.sleep(boundary_s if boundary else micro_s)
        try:
            meter.micro_step_done(boundary)
        except ProbeDone:
            return i
    raise AssertionError("the meter never ended the run")


def test_micro_step_meter_stops_at_a_boundary_once_the_interval_is_tight():
    meter = StepMeter(warmup=2, steps=5, target_ci=0.25)
    n = _drive(meter, accum=8, micro_s=0.004, boundary_s=0.012)
    assert n % 8 == 0  # at an accumulation boundary
    assert n < (1 + 5) * 8  # before the whole-step budget (warm-up is 1 step at accumulation 8)
    est = meter.estimate
    assert est.relative_half_width <= 0.25
    assert est.step_time_s == pytest.approx(7 * 0.004 + 0.012, rel=0.5)  # sleeps overshoot on a loaded machine
    assert meter.as_dict()["step_time"] == est.step_time_s


def test_micro_step_meter_stops_at_the_step_budget_when_never_tight():
    meter = StepMeter(warmup=1, steps=2, target_ci=1e-9)
    n = _drive(meter, accum=4, micro_s=0.001, boundary_s=0.002)
    assert n == (1 + 2) * 4  # warm-up step + 2 measured steps' worth of micro-steps


def _timing(step, predicted=1.0, wall=30.0, steps=7):
    return ProbeTiming(predicted_step_time_s=predicted, step_time_s=step, wall_s=wall, optimizer_steps=steps)


def test_probe_timeout_from_the_probes_that_worked():
    assert probe_timeout(2.0, [], ceiling_s=300, optimizer_steps=7) == (300, False)
    # Two probes: measured step times are 0.5× the predictions; fixed part 30 − 7·0.5 = 26.5 s and 30 − 7·1.0 = 23 s.
    history = [_timing(0.5, predicted=1.0), _timing(1.0, predicted=2.0)]
    expected = statistics.median([26.5, 23.0]) + 7 * 0.5 * 4.0
    assert probe_timeout(4.0, history, ceiling_s=300, optimizer_steps=7) == (pytest.approx(TIMEOUT_MARGIN * expected + TIMEOUT_SLACK_S), True)
    assert probe_timeout(400.0, history, ceiling_s=300, optimizer_steps=7) == (300, False)  # --timeout stays the ceiling


def test_first_probe_timeout_from_the_predicted_start_up_and_steps():
    from zeroplan.tuner.probetime import FIRST_TIMEOUT_MARGIN, FIRST_TIMEOUT_SLACK_S, first_probe_timeout

    # 8 s to import torch, 3 optimizer steps predicted at 2 s: 5 × (8 + 6) + 60 = 130 s.
    assert FIRST_TIMEOUT_MARGIN * (8 + 3 * 2.0) + FIRST_TIMEOUT_SLACK_S == 130
    assert first_probe_timeout(2.0, startup_s=8.0, optimizer_steps=3, ceiling_s=300) == (pytest.approx(130.0), True)
    assert first_probe_timeout(2.0, startup_s=8.0, optimizer_steps=3, ceiling_s=120) == (120, False)  # --timeout caps it
    # probe_timeout uses it only before any probe worked; measurements win after.
    assert probe_timeout(2.0, [], ceiling_s=300, optimizer_steps=3, startup_s=8.0) == (pytest.approx(130.0), True)
    history = [_timing(1.0, predicted=2.0, wall=20.0, steps=3)]
    assert probe_timeout(2.0, history, ceiling_s=300, optimizer_steps=3, startup_s=8.0) == (pytest.approx(TIMEOUT_MARGIN * 20.0 + TIMEOUT_SLACK_S), True)


def test_cpu_probes_are_ordered_by_this_machines_speeds_not_a_datasheet():
    from zeroplan.cli.common import resolve_cluster
    from zeroplan.tuner.cpu_profile import time_model_for_probes

    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    same, note = time_model_for_probes(cluster, on_cuda=False, gpu_given=True)
    assert same is cluster and note.startswith("time model: ")
    cpu, note = time_model_for_probes(cluster, on_cuda=False, gpu_given=False)
    assert note.startswith("time model: this CPU measured now") and cpu.gpu.name == "cpu-quick"
    # Memory (what the estimator prunes with) is unchanged; speeds are this CPU's: a few server
    # cores do not reach 1% of an A100's datasheet fp32/bf16 peaks (19.5 / 312 TFLOP/s).
    assert cpu.gpu_memory_bytes == cluster.gpu_memory_bytes and cpu.gpus == cluster.gpus
    for prec in ("fp32", "bf16"):
        assert 1e8 < cpu.gpu.peak_flops[prec] < 0.01 * cluster.gpu.peak_flops[prec]
    # Gloo between two forked ranks, measured: slower per call than NVLink's 20 µs α, and a link far
    # below the A100's 300 GB/s NVLink; a hook call costs a fraction of a millisecond.
    assert cpu.gpu.collective_latency_s > cluster.gpu.collective_latency_s
    assert 1e6 < cpu.gpu.intra_node_bandwidth < 0.1 * cluster.gpu.intra_node_bandwidth
    assert 0 < cpu.gpu.hook_call_s < 1e-3


def test_predicted_gap_scales_predictions_to_the_measurements():
    from zeroplan.tuner.probetime import predicted_gap

    # Measured throughput is half the prediction on this machine; the best unprobed plan is predicted
    # 240/s, i.e. 120/s here, against 100/s measured best: 20% faster.
    gap = predicted_gap(100.0, [(200.0, 100.0), (160.0, 80.0)], [("z2/mb8", 240.0), ("z0/mb4", 150.0)])
    assert (gap.plan_key, gap.unprobed) == ("z2/mb8", 2) and gap.fraction == pytest.approx(0.2)
    assert predicted_gap(100.0, [(200.0, 100.0)], []).plan_key is None


def test_time_budget_starts_no_probe_that_would_end_past_it(tmp_path):
    from helpers import Replay, make_space
    from zeroplan.tuner import TuneSettings, Tuner, make_sampler, open_study, storage_url

    class Slow(Replay):
        def __call__(self, plan, **kw):
            time.sleep(2.0)
            return super().__call__(plan, **kw)

    study = open_study(storage_url(None, tmp_path), resume=False, sampler=make_sampler("tpe", seed=1))
    # Seconds, not tenths: the search's own start (study, first proposals) took 0.75 s once on a
    # loaded machine, which a 0.9 s budget could not absorb.
    tuner = Tuner(study, make_space(), Slow(oom_from=None), TuneSettings(trials=50, time_budget_s=4.5), expected_probe_s=lambda plan: 3.0)
    tuner.prepare(resume=False)
    summary = tuner.run()
    # The first probe fits (start + 3 ≤ 4.5 while the start takes < 1.5 s); after it (≥ 2 s) the
    # next would end past 4.5 s.
    assert summary.stopped_because == "time budget" and summary.probes_this_run == 1
    assert summary.gap is not None and summary.gap.unprobed > 0


@pytest.mark.e2e
def test_fsdp_probe_times_micro_steps(tmp_path):
    """An FSDP2 probe at accumulation 4 with --ci stops on the micro-step interval, as DeepSpeed's do."""
    from pathlib import Path

    from zeroplan.spec import Plan, TrainingSpec
    from zeroplan.tuner.objective import ProbeRunner

    task = ROOT / "examples" / "gpt_task.py"
    runner = ProbeRunner(script=task, nproc=2, training=TrainingSpec(seq_len=64, global_batch=16), model=None, workdir=tmp_path,
                         backend="fsdp", steps=3, warmup=1, timeout_s=300, target_ci=0.5)
    outcome = runner(Plan(stage=3, micro_batch=2, gradient_accumulation_steps=4), trial_number=0)
    assert outcome.ok, outcome.error
    assert outcome.micro_steps >= 4 and outcome.step_time_ci_s is not None and outcome.step_time_ci_s > 0


def test_a_plan_of_another_start_up_class_never_gets_a_faster_plans_timeout():
    """The issue's case: a fast ZeRO-0 probe (3.0 s wall, 7 steps of 0.05 s) must not set the
    timeout of a ZeRO-3 + CPU offload plan, whose start-up loads cpu_adam and partitions every
    parameter: that plan gets the first-probe rule, its start-up at least the machine's floor."""
    from zeroplan.tuner.probetime import first_probe_timeout

    fast = ProbeTiming(predicted_step_time_s=0.1, step_time_s=0.05, wall_s=3.0, optimizer_steps=7, startup_class="z0")
    same, _ = probe_timeout(0.1, [fast], ceiling_s=300, optimizer_steps=7, startup_s=5.0, startup_class="z0")
    # Same class: derived from its own fixed part (3.0 − 0.35 = 2.65 s).
    assert same == pytest.approx(TIMEOUT_MARGIN * (2.65 + 7 * 0.05) + TIMEOUT_SLACK_S)
    other = probe_timeout(0.1, [fast], ceiling_s=300, optimizer_steps=7, startup_s=5.0, startup_class="z3+opt:cpu+param:cpu")
    # Another class: start-up max(floor 5.0, slowest fixed part 2.65), steps at the measured scale (≥ 1).
    assert other == first_probe_timeout(0.1, startup_s=5.0, optimizer_steps=7, ceiling_s=300)
    assert other[0] > 2 * same
    # Once a probe of that class worked, its own start-up is what counts, however slow.
    slow = ProbeTiming(predicted_step_time_s=0.1, step_time_s=0.05, wall_s=40.0, optimizer_steps=7, startup_class="z3+opt:cpu+param:cpu")
    derived, ok = probe_timeout(0.1, [fast, slow], ceiling_s=300, optimizer_steps=7, startup_s=5.0, startup_class="z3+opt:cpu+param:cpu")
    assert ok and derived == pytest.approx(TIMEOUT_MARGIN * (40.0 - 0.35 + 0.35) + TIMEOUT_SLACK_S)


def test_a_wait_that_is_not_the_jobs_moves_its_deadline(tmp_path):
    """Job.wait with ``not_charged``: a job that spends 4 s waiting on someone else's work (until a
    file says the build is done) and then 0.2 s on its own finishes under a 3 s timeout; the same
    job with every second charged times out."""
    import sys

    from zeroplan.runtime.launch.job import Job

    built = tmp_path / "built"
    code = f"import pathlib, time; time.sleep(4); pathlib.Path({str(built)!r}).touch(); time.sleep(0.2)"

    def job():
        built.unlink(missing_ok=True)
        return Job([sys.executable, "-c", code], None, tmp_path, tmp_path / "log.txt", None)

    waiting = job()
    returncode, timed_out = waiting.wait(3.0, not_charged=lambda: not built.exists())
    waiting.close()
    assert (returncode, timed_out) == (0, False) and waiting.not_charged_s >= 3.0
    charged = job()
    returncode, timed_out = charged.wait(3.0)
    charged.kill_all()
    charged.close()
    assert timed_out and charged.not_charged_s == 0.0


def test_failures_outside_the_plan_are_told_apart():
    from zeroplan.tuner.failures import outside_plan

    assert outside_plan("timeout", "", waits_s={"op build": 42.0}).startswith("timed out after waiting 42 s on a DeepSpeed op build")
    assert outside_plan("error", "rank 0: DistNetworkError: The server socket has failed to listen on any local network address. "
                                 "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use") is not None
    assert outside_plan("error", "rank 1: RuntimeError: Error building extension 'cpu_adam'") is not None
    # The plan's own failures are not: an OOM, a crash in the script, a plain timeout.
    assert outside_plan("oom", "CUDA out of memory", waits_s={"op build": 3.0}) is None
    assert outside_plan("error", "rank 0: RuntimeError: shapes (4x8 and 16x8) cannot be multiplied") is None
    assert outside_plan("timeout", "", waits_s={"launcher": 20.0}) is None
