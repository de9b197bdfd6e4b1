"""zeroplan calibrate: the α + S/B fit, the measurements, the profile it writes, bad input, Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeroplan.calibrate import CalibrationOptions, fit_latency_bandwidth, planned_steps, ring_bytes
from zeroplan.spec import SpecError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _zeroplan(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeroplan", *args], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)


def test_ring_bytes_are_nccl_tests_bus_bytes():
    # nccl-tests PERFORMANCE.md: busbw = algbw · (n−1)/n for all-gather/reduce-scatter, · 2(n−1)/n for all-reduce.
    assert ring_bytes("all_gather", 8_000, 8) == 7_000
    assert ring_bytes("reduce_scatter", 8_000, 8) == 7_000
    assert ring_bytes("all_reduce", 8_000, 8) == 14_000


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_latency_and_bandwidth(n):
    alpha, bandwidth = 30e-6, 12e9
    sizes = [2**k for k in range(10, 28, 3)]
    samples = []
    for c, k in (("all_reduce", 2), ("all_gather", 1), ("reduce_scatter", 1)):
        for s in sizes:
            samples.append((c, s, k * alpha * (n - 1) + ring_bytes(c, s, n) / bandwidth))
    fit = fit_latency_bandwidth(samples, n)
    assert fit.latency_s == pytest.approx(alpha, rel=1e-6)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fit.max_relative_residual < 1e-9


def test_fit_with_noise_and_a_negative_intercept_stays_physical():
    import random

    rng = random.Random(0)
    n, bandwidth = 2, 1e9
    # Pure bandwidth (α = 0) with ±5% noise: the fit must not return a negative latency.
    samples = [("all_gather", s, ring_bytes("all_gather", s, n) / bandwidth * rng.uniform(0.95, 1.05)) for s in (2**k for k in range(12, 26))]
    fit = fit_latency_bandwidth(samples, n)
    assert fit.latency_s >= 0
    assert fit.bandwidth == pytest.approx(bandwidth, rel=0.1)


def test_measurements_on_this_cpu_are_plausible():
    torch = pytest.importorskip("torch")
    from zeroplan.calibrate import measure

    cpu = torch.device("cpu")
    flops, n = measure.matmul_flops("fp32", cpu, budget_s=0.2, max_n=512)
    assert n in (256, 512)
    assert 1e8 < flops < 1e13  # a CPU core does between 0.1 GFLOP/s and 10 TFLOP/s
    bandwidth = measure.memory_bandwidth(cpu, size_bytes=32 * 2**20, budget_s=0.2)
    assert 1e8 < bandwidth < 1e12
    per_s, name = measure.adam_throughput(params=2**18, budget_s=0.2, use_deepspeed=False)
    assert name == "torch.optim.AdamW" and per_s > 1e5
    # The Adam step really updates the parameters (the timing is of real work).
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.ones(4)
    torch.optim.AdamW([p], lr=0.1).step()
    assert (p < 0).all()


def test_planned_steps_cover_every_collective_size():
    quick = CalibrationOptions(processes=2, quick=True)
    steps = planned_steps(quick)
    assert len([s for s in steps if s.startswith("all_reduce")]) == len(quick.collective_sizes)
    assert not [s for s in planned_steps(CalibrationOptions(processes=1, quick=True)) if "all_" in s]


@pytest.mark.parametrize(
    "kwargs, message",
    [({"processes": 0}, "--gpus 0"), ({"device": "tpu"}, "device"), ({"precision": "fp8"}, "--precision"),
     ({"task": "/nonexistent/task.py"}, "--task")],
)
def test_bad_options_are_spec_errors(kwargs, message):
    with pytest.raises(SpecError, match=message):
        CalibrationOptions(**kwargs)


@pytest.mark.parametrize(
    "args, message",
    [(["--gpus", "0"], "--gpus 0"), (["-o", "/nonexistent/dir/p.toml"], "does not exist"), (["--device", "cuda"], "cuda")],
)
def test_cli_bad_input_exits_2(args, message):
    pytest.importorskip("torch")
    import torch

    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    r = _zeroplan("calibrate", "--quick", *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_quick_calibrate_writes_a_profile_the_estimator_accepts(tmp_path):
    pytest.importorskip("torch")
    from zeroplan.profiles import gpu_from_toml

    profile = tmp_path / "profile.toml"
    r = _zeroplan("calibrate", "--quick", "--gpus", "2", "-o", str(profile), timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    gpu = gpu_from_toml(profile)
    import psutil

    assert gpu.memory_bytes == psutil.virtual_memory().total  # on CPU the "GPU" memory is the RAM
    assert all(1e8 < gpu.peak_flops[p] < 1e15 for p in ("bf16", "fp32"))
    assert 0 < gpu.efficiency <= 1 and gpu.collective_latency_s >= 0
    assert "[calibration]" in profile.read_text()
    est = _zeroplan("estimate", "--params", "5e6", "--gpus", "2", "--gpu", str(profile), "--seq-len", "64", "--format", "json")
    assert est.returncode in (0, 1), est.stderr
    assert '"step_time"' in est.stdout


@pytest.mark.slow
def test_interrupted_calibrate_leaves_no_file(tmp_path):
    pytest.importorskip("torch")
    profile = tmp_path / "profile.toml"
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeroplan", "calibrate", "--quick", "-o", str(profile)],
        env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    time.sleep(8)  # workers started, measuring
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the whole foreground group
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # neither the profile nor a temporary file
