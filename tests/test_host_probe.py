"""Host memory measurement pieces: the kernel's per-phase peak RSS, the node sum, OOM kinds, tuner rules."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from zeroplan.runtime.measure.hostmem import NodeRssSampler, PhaseRss, memory_limit, node_rss, summarize_host
from zeroplan.spec import ClusterSpec, GiB, ModelSpec, Plan, TrainingSpec
from zeroplan import profiles
from zeroplan.tuner.hostrule import host_fit_reason, host_oom_rule

MiB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_phase_peaks_follow_a_known_allocation():
    """A 200 MiB buffer touched in engine_init and freed: that phase's peak holds it, the next does not."""
    meter = PhaseRss()
    meter.start()
    buf = bytearray(200 * MiB)
    buf[:: 4096] = b"\x01" * len(range(0, len(buf), 4096))  # touch every page
    meter.enter("engine_init")  # closes model_build, which held the buffer
    del buf
    meter.enter("step")
    meter.finish()
    peaks = meter.peaks
    assert meter.reset  # clear_refs works here; else phases would be cumulative
    assert peaks["model_build"] - meter.baseline_bytes >= 200 * MiB
    assert peaks["step"] < peaks["model_build"] - 150 * MiB


def test_node_rss_counts_shared_pages_once():
    child = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"  # started: its RSS no longer grows
        me = psutil.Process().memory_info()
        assert abs(node_rss([os.getpid()]) - me.rss) < 1 * MiB  # read a moment apart: a page may move
        both = node_rss([os.getpid(), child.pid])
        kid = psutil.Process(child.pid).memory_info()
        expected = (me.rss - me.shared) + (kid.rss - kid.shared) + max(me.shared, kid.shared)
        assert abs(both - expected) < 1 * MiB  # read a moment apart: pages may move by a few KiB
        assert both < me.rss + kid.rss  # the interpreter's shared pages once, not twice
    finally:
        child.kill()
        child.wait()


def test_node_rss_leaves_out_an_op_build(tmp_path):
    """A compiler started to JIT-build an op (named cc1plus here: a copy of this interpreter holding
    100 MiB) is not the job's footprint; the same program under another name is counted."""
    import shutil

    prog = "import time; b = bytearray(100 << 20); b[::4096] = b'\\x01' * len(range(0, len(b), 4096)); print('ready', flush=True); time.sleep(30)"
    counted = {}
    for name in ("cc1plus", "trainer"):
        exe = tmp_path / name
        shutil.copy(sys.executable, exe)
        child = subprocess.Popen([str(exe), "-c", prog], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout.readline().strip() == "ready"
            counted[name] = node_rss([child.pid])
        finally:
            child.kill()
            child.wait()
    assert counted["cc1plus"] == 0
    assert counted["trainer"] >= 100 * MiB


_FORKING_WORKER = """
import os, sys, time
buf = bytearray(200 << 20)
buf[::4096] = b"\\x01" * len(range(0, len(buf), 4096))  # 200 MiB resident
pid = os.fork()  # a forked helper (py-cpuinfo, a data loader) shares them copy-on-write
if pid == 0:
    time.sleep(30)
    os._exit(0)
print(pid, flush=True)
time.sleep(30)
"""


def test_node_rss_counts_a_workers_forked_child_by_its_own_pages():
    """torchrun → worker → fork: the child's copy-on-write pages are the worker's, counted once."""
    agent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_FORKING_WORKER!r}])"],
                             stdout=subprocess.PIPE, text=True)
    try:
        forked = int(agent.stdout.readline())
        worker = psutil.Process(forked).ppid()
        tree = [agent.pid, worker, forked]
        rss = {pid: psutil.Process(pid).memory_info().rss for pid in tree}
        assert rss[forked] > 190 * MiB  # its rss repeats the worker's 200 MiB
        assert node_rss(tree) < rss[agent.pid] + rss[worker] + 20 * MiB
    finally:
        for proc in psutil.Process(agent.pid).children(recursive=True):
            proc.kill()
        agent.kill()
        agent.wait()


def test_sampler_phase_peaks_and_baseline():
    s = NodeRssSampler(lambda: [])
    s.samples = [(0.0, 100), (1.0, 150), (2.0, 400), (3.0, 300), (4.0, 900), (5.0, 200)]
    ranks = [
        {"rank": 0, "host_peak": 500, "host_phase_starts": {"model_build": 0.5, "engine_init": 2.0, "step": 3.5}},
        {"rank": 1, "host_peak": 450, "host_phase_starts": {"model_build": 0.9, "engine_init": 2.1, "step": 3.6}},
    ]
    out = summarize_host(ranks, s)
    assert out["host_peak_per_node"] == 900 and out["host_peak_per_rank"] == [500, 450]
    assert out["host_phase_peaks_per_node"] == {"model_build": 150, "engine_init": 400, "step": 900}
    assert out["host_baseline_per_node"] == 150  # first sample once both ranks run user code


@pytest.mark.parametrize("status, error, kind, expected", [
    ("oom", "CUDA out of memory. Tried to allocate 2.00 GiB", "cuda", "device"),
    ("oom", "RuntimeError: DefaultCPUAllocator: can't allocate memory", "cuda", "host"),
    ("oom", "a worker was killed by SIGKILL with no result", "cuda", "host"),
    ("oom", "MemoryError", "cpu-storage", "host"),
    ("ok", None, "cuda", None),
])
def test_memory_limit(status, error, kind, expected):
    assert memory_limit(status, error, kind) == expected


def test_tuner_host_rules():
    from zeroplan.estimator import estimate_plan

    model = ModelSpec.from_params(13e9)
    cl = ClusterSpec(gpus=8, gpus_per_node=8, gpu=profiles.load_gpu("a100-80gb"), cpu_memory_per_node_bytes=256 * GiB)
    plan = Plan(stage=2, offload_optimizer="cpu", micro_batch=1, checkpointing="full")
    est = estimate_plan(model, cl, TrainingSpec(), plan, model_save="engine")
    reason = host_fit_reason(est, cl)
    assert reason == f"predicted {est.cpu_per_node / GiB:.2f} GiB host memory per node at model build > 256.00 GiB"
    # The default GPU estimate saves as the Trainer does: every rank's 16-bit copy on top of the
    # offloaded states (zeroplan.estimator.host_save) makes the save the worst phase here.
    trainer = estimate_plan(model, cl, TrainingSpec(), plan)
    assert host_fit_reason(trainer, cl) == f"predicted {trainer.cpu_per_node / GiB:.2f} GiB host memory per node at checkpoint save > 256.00 GiB"
    assert trainer.cpu_per_node > est.cpu_per_node
    roomy = ClusterSpec(gpus=8, gpus_per_node=8, gpu=cl.gpu, cpu_memory_per_node_bytes=4096 * GiB)
    assert host_fit_reason(est, roomy) is None
    assert host_oom_rule(10 * GiB, [(3, "z2+opt:cpu mb1", 8 * GiB)]).startswith("needs more host memory than")
    assert host_oom_rule(7 * GiB, [(3, "z2+opt:cpu mb1", 8 * GiB)]) is None


def test_memory_tracking_ends_with_warmup_and_keeps_its_peak():
    """Timed steps run without the tracker; the peak of the warm-up (a known 8 MiB tensor) stays."""
    torch = pytest.importorskip("torch")
    from zeroplan.runtime.measure.memory import PeakMemory
    from zeroplan.runtime.rank.worker import ProbeDone, StepMeter

    memory = PeakMemory(torch.device("cpu"))
    calls = []
    meter = StepMeter(warmup=1, steps=2, current_bytes=lambda: memory.current_bytes,
                      on_timing_start=lambda: (calls.append(meter.count), memory.stop_tracking()))
    with memory:
        x = torch.empty(2 * MiB, dtype=torch.float32)  # 8 MiB in the warm-up step
        meter.before_optimizer_step()
        del x
        meter.optimizer_step_done()  # end of warm-up: tracking stops here
        y = torch.empty(64 * MiB, dtype=torch.uint8)  # a timed step: not seen
        meter.before_optimizer_step()
        meter.optimizer_step_done()
        with pytest.raises(ProbeDone):
            meter.before_optimizer_step()
            meter.optimizer_step_done()
    assert calls == [1] and memory.peak_bytes == 8 * MiB and meter.state_bytes == 8 * MiB
    assert len(meter.step_times) == 2 and y.numel() == 64 * MiB


def test_tune_space_prunes_plans_over_the_hosts_ram():
    """--cpu-memory below a plan's worst host phase: the tuner's space prunes it, naming the phase."""
    from zeroplan.profiles import resolve_cluster
    from zeroplan.tuner import build_space

    model = ModelSpec.from_params(1.3e9)
    training = TrainingSpec(seq_len=512, micro_batch=1)
    cluster = resolve_cluster(gpus=8, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib="48",
                              nvme_gib=None, runs_here=True)
    space = build_space(model, cluster, training, offload_optimizer=["none", "cpu"], offload_param=["none"], device="cuda")
    def phase(c) -> str | None:
        return c.reason.split(" at ")[1].split(" > ")[0] if "host memory per node at" in c.reason else None

    for c in space.candidates:
        if c.plan.stage < 3 and c.plan.offload_optimizer == "none":
            # Stages 0-2 build the fp32 model on every rank: 8 × (4 × 1.3e9 + the untied head + 2 GiB) > 48 GiB.
            assert phase(c) == "model build" and not c.fits
        elif c.plan.stage < 3:
            # With the optimizer states offloaded, the Trainer's save (every rank's 16-bit copy on
            # the host beside them, zeroplan.estimator.host_save) is worse than the build.
            assert phase(c) == "checkpoint save" and not c.fits
        else:
            # zero.Init: partitioned as built; the offloaded states are 1/8 of the model per rank.
            assert phase(c) is None
