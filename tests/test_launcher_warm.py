"""The warm launcher: ranks forked from a server that imported torch and DeepSpeed once.

The reference is torchrun: the same probe under both must measure the same tensor memory per rank
(the CPU storage tracker is deterministic), and a rank killed by SIGKILL must read as torchrun's
does (the kernel's OOM killer). Faults, timeouts and Ctrl-C under the warm launcher are checked by
tests/test_runtime_faults.py, which runs on the default launcher.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from zeroplan.cli.nodes import resolve_nodes
from zeroplan.runtime import ProbeRequest, run_probe, uses_warm_launcher
from zeroplan.runtime.launch.multinode import NodeLaunch
from zeroplan.spec import Plan, SpecError, TrainingSpec

from helpers import ROOT, run_zeroplan
SCRIPT = ROOT / "examples" / "train_deepspeed.py"


def test_bad_launcher_values_fail_at_the_boundary():
    with pytest.raises(SpecError, match="launcher='fork' is not valid; choose one of warm, torchrun"):
        ProbeRequest(script=SCRIPT, launcher="fork")
    with pytest.raises(SpecError, match="--launcher fork is not valid; choose one of warm, torchrun, slurm"):
        resolve_nodes(gpus=2, gpus_per_node=None, nnodes=1, launcher="fork", node_rank=None, rdzv_endpoint=None, rdzv_timeout=120)
    with pytest.raises(SpecError, match="--launcher warm starts the ranks of one node; with --nnodes 2 use --launcher torchrun"):
        resolve_nodes(gpus=4, gpus_per_node=None, nnodes=2, launcher="warm", node_rank=0, rdzv_endpoint="h:29500", rdzv_timeout=120)


def test_which_probes_use_the_warm_launcher():
    assert uses_warm_launcher(ProbeRequest(script=SCRIPT))
    assert not uses_warm_launcher(ProbeRequest(script=SCRIPT, launcher="torchrun"))
    assert not uses_warm_launcher(ProbeRequest(script=SCRIPT, torchrun_args=("--max-restarts=0",)))
    two = NodeLaunch(nnodes=2, launcher="torchrun", node_rank=0, rdzv_endpoint="h:29500")
    assert not uses_warm_launcher(ProbeRequest(script=SCRIPT, nodes=two))


def test_cpu_ranks_compute_with_one_thread_unless_the_user_says(monkeypatch):
    from zeroplan.runtime.probe import probe_environment
    from zeroplan.runtime.rank.threads import rank_threads

    assert rank_threads(2, on_cuda=False, env={}) == 1
    assert rank_threads(1, on_cuda=False, env={"OMP_NUM_THREADS": "8"}) == 8
    assert rank_threads(1, on_cuda=False, env={"OMP_NUM_THREADS": "lots"}) == 1
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert rank_threads(4, on_cuda=True, env={}) == 4
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("zeroplan.profiles.detect.local_gpu_count", lambda: None)
    assert probe_environment(ProbeRequest(script=SCRIPT, nproc=1))["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert probe_environment(ProbeRequest(script=SCRIPT, nproc=1))["OMP_NUM_THREADS"] == "3"


def test_cli_bad_launcher_is_one_line_and_exit_2(tmp_path):
    r = run_zeroplan("probe", str(SCRIPT), "--gpus", "2", "--stage", "1", "--launcher", "fork")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--launcher fork is not valid; choose one of warm, torchrun, slurm" in lines[0], r.stderr


def _probe(tmp_path: Path, launcher: str):
    plan = Plan(stage=2, micro_batch=2)
    return run_probe(ProbeRequest(script=SCRIPT, nproc=2, plan=plan, training=TrainingSpec(seq_len=64), script_args=("--steps", "10"),
                                  steps=1, warmup=1, timeout_s=300, workdir=tmp_path / launcher, launcher=launcher))


@pytest.mark.slow
def test_warm_measures_what_torchrun_measures(tmp_path):
    torchrun = _probe(tmp_path, "torchrun")
    warm = _probe(tmp_path, "warm")
    assert (torchrun.status, warm.status) == ("ok", "ok"), (torchrun.error, warm.error)
    assert (torchrun.launcher, warm.launcher, warm.launcher_note) == ("torchrun", "warm", None)
    # The same tensors on the same ranks: the CPU storage tracker's peaks agree to the byte.
    assert warm.peak_memory_per_rank == torchrun.peak_memory_per_rank
    # The bytes live just before the optimizer step agree within one small tensor: rank 0 read
    # 1,238,028 or 1,511,948 B across two torchrun runs of this plan on a quiet machine (a 273,920-B
    # tensor alive or not at that moment).
    assert all(abs(w - t) <= 300_000 for w, t in zip(warm.state_memory_per_rank, torchrun.state_memory_per_rank))
    assert warm.world_size == torchrun.world_size == 2 and warm.steps == torchrun.steps == 1
    # Both report where the time went, from the worker's start to the report.
    for r in (torchrun, warm):
        assert {"launch", "imports", "script", "engine", "warmup", "measure", "teardown"} <= set(r.phases_s), r.phases_s
    # Each rank computes with the same intra-op pool under both, as torch in the rank reports it:
    # one thread per CPU rank (zeroplan.runtime.rank.threads), also in ranks forked from the server.
    for launcher in ("torchrun", "warm"):
        for rank in (0, 1):
            threads = json.loads((tmp_path / launcher / f"rank-{rank}.json").read_text())["threads"]
            assert threads["torch_threads"] == 1 and threads["env"]["OMP_NUM_THREADS"] == "1", (launcher, threads)


@pytest.mark.slow
def test_a_rank_killed_by_sigkill_reads_as_the_oom_killer(tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # rank 0 waits, as in a collective; the leader must stop it
    """))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0}}
    r = run_probe(ProbeRequest(script=script, ds_config=config, timeout_s=100, workdir=tmp_path / "w"))
    assert r.launcher == "warm"
    assert r.status == "oom" and "SIGKILL" in r.error, r.error
    assert "exitcode : -9" in r.log_tail


@pytest.mark.slow
def test_a_server_that_does_not_answer_is_stopped_and_replaced(tmp_path):
    """A stuck server (here stopped with SIGSTOP) costs one probe's fallback to torchrun, at most
    that probe's timeout of waiting; it is killed, and the next probe gets a fresh server."""
    import os
    import signal
    import time

    from zeroplan.runtime.launch import warm

    env = {**os.environ, "ZEROPLAN_TEST": "stuck"}
    server = warm.begin(env, log_path=tmp_path / "server.log", ready_timeout_s=120)
    server.wait_ready()
    os.kill(server.proc.pid, signal.SIGSTOP)
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    started = time.monotonic()
    with pytest.raises(warm.WarmUnavailable, match="the server did not start the probe"):
        warm.start_warm_job(spec_path=spec, nproc=1, env=env, cwd=tmp_path, log_path=tmp_path / "probe.log", on_line=None, ready_timeout_s=2)
    assert time.monotonic() - started < 15  # the probe's own timeout bounds the wait, then the kill
    assert server.proc.poll() is not None and warm._server is None
    fresh = warm.begin(env, log_path=tmp_path / "server.log", ready_timeout_s=120)
    assert fresh is not server
    warm.shutdown()
