"""Probes across nodes: two torchrun agents on this machine as two nodes (c10d rendezvous on
localhost, gloo), and ``--launcher slurm`` through a fake srun (tests/fake_slurm: detached
per-node tasks, signal forwarding, scancel), with timeouts, kills and bad input."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zeroplan.runtime.launch.multinode import NodeLaunch, check_node_layout, expand_hostlist
from zeroplan.spec import SpecError

from helpers import ROOT, run_zeroplan
FAKE_SLURM = ROOT / "tests" / "fake_slurm"
TASK = ROOT / "examples" / "gpt_task.py"

# A task whose loading hangs; each "node" records its worker pid and a grandchild's pid.
HANG_TASK = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.path.join(os.environ["PID_DIR"], f"pid-{os.getpid()}"), "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
def zeroplan_task():
    pass
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(ROOT), COLUMNS="200", **extra)
    return env


def _slurm_env(tmp_path: Path, nodelist: str = "localhost,127.0.0.1", **extra: str) -> dict[str, str]:
    return _env(
        PATH=f"{FAKE_SLURM}{os.pathsep}{os.environ['PATH']}",
        FAKE_SLURM_DIR=str(tmp_path / "slurm"),
        FAKE_SLURM_PYTHON=sys.executable,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST=nodelist,
        **extra,
    )


def _zeroplan(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return run_zeroplan(*args, env=env, timeout=timeout)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_dead(pids: list[int], within_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while [p for p in pids if _alive(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


# --- host lists, layouts, bad input (fast) ---------------------------------------------------


@pytest.mark.parametrize(
    "text, hosts",
    [
        # scontrol(1): "scontrol show hostnames tux[1-3]" prints tux1 tux2 tux3.
        ("tux[1-3]", ["tux1", "tux2", "tux3"]),
        # Zero padding is kept, lists and ranges mix, plain names pass through (Slurm hostlist.c).
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("node-a,node-b", ["node-a", "node-b"]),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


def test_expand_hostlist_rejects_broken_lists():
    with pytest.raises(SpecError, match="unmatched"):
        expand_hostlist("gpu[01-03")
    with pytest.raises(SpecError, match="not valid"):
        expand_hostlist("gpu[03-01]")


def test_follower_started_after_the_leader_finished_returns_at_once(tmp_path, capsys):
    """`tune --node-rank 1` finding node 0's done marker (written less than --rdzv-timeout ago)
    joins nothing and stops; an older marker would be from an earlier run and is removed."""
    from types import SimpleNamespace

    from zeroplan.cli.nodes import follow_node0
    from zeroplan.runtime import FOLLOW_DONE

    probes = tmp_path / "probes"
    probes.mkdir()
    (probes / FOLLOW_DONE).touch()
    follow_node0(probes, SimpleNamespace(node_rank=1, rdzv_timeout_s=60.0))
    assert "node 1: node 0's tuner is done; joined 0 probes" in capsys.readouterr().out
    assert (probes / FOLLOW_DONE).exists()


# Node 0's log tail when node 1's agent (which held the c10d store) was SIGKILLed at step 232,
# torch 2.x: the elastic agent polls the store while the workers train (api.py _invoke_run).
STORE_LOST_TAIL = """\
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/agent/server/api.py", line 959, in _invoke_run
    num_nodes_waiting = rdzv_handler.num_nodes_waiting()
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 116, in _call_store
    raise RendezvousConnectionError(
torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed. See inner exception for details.
"""


class _Clock:
    """A monotonic clock that only moves when the code under test sleeps (or the test says so)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _beat(workdir: Path, node: int, beat: int, *, step=None, ended=False) -> None:
    (workdir / f"alive-node-{node}.json").write_text(json.dumps({"node_rank": node, "beat": beat, "step": step, "ended": ended}))


def _two_node_folder(tmp_path: Path):
    from zeroplan.runtime.launch.multinode import NodeWatch, ProgressTracker

    for k in (0, 1):
        (tmp_path / f"node-{k}.json").write_text(json.dumps({"node_rank": k, "started_unix": time.time()}))
    launch = NodeLaunch(nnodes=2, node_rank=0, rdzv_endpoint="localhost:29500")
    clock, progress = _Clock(), ProgressTracker()
    watch = NodeWatch(tmp_path, launch, stale_s=6.0, interval_s=2.0, progress=progress, clock=clock, sleep=clock.sleep)
    _beat(tmp_path, 1, 1)
    watch()  # t=0: node 1's first beat is only "seen"
    return launch, clock, progress, watch


def _reason(launch, tmp_path, watch, progress, log_tail, ranks=()):
    from zeroplan.runtime.probe import _nodes_reason

    error = "torchrun failed; 2 of 2 ranks wrote no result (exit code 1)"
    return _nodes_reason(launch, {"endpoint": "localhost:29500"}, tmp_path, list(ranks), log_tail, "error", error, time.time(),
                         watch=watch, progress=progress)


def test_store_lost_after_training_names_the_silent_node_and_its_last_step(tmp_path):
    """Rank 0 ran on node 1 (its heartbeat carries the step); node 0's own log shows only the lost
    c10d store. Before the fix this read as 'not all reached the rendezvous'."""
    from zeroplan.runtime.launch.multinode import last_step_seen, rendezvous_failure

    launch, clock, progress, watch = _two_node_folder(tmp_path)
    clock.now = 2.2
    _beat(tmp_path, 1, 2, step=232)
    watch()
    clock.now = 3.0  # node 1 is killed; node 0's job ends with the store error
    # Read without the heartbeats, the same text is a start-up failure (right before training).
    assert rendezvous_failure(STORE_LOST_TAIL, launch=launch, endpoint="localhost:29500", missing=[]) == (
        "cannot reach the rendezvous at localhost:29500: every node's launcher started, but not all reached the rendezvous")
    assert rendezvous_failure(STORE_LOST_TAIL, launch=launch, endpoint="localhost:29500", missing=[],
                              last_step=last_step_seen(STORE_LOST_TAIL, watch.heartbeats)) is None
    reason, lost = _reason(launch, tmp_path, watch, progress, STORE_LOST_TAIL)
    assert lost and reason == (
        "node rank 1 was lost mid-training (last step seen: 232): its agent's heartbeat (alive-node-1.json) has not changed "
        "for 6 s (agent killed or node lost); this node's job failed without it")
    assert 8.2 < clock.now <= 3.0 + 6.0 + 2 * 2.0  # waited until node 1 was silent for stale_s, no longer
    assert json.loads((tmp_path / "alive-node-0.json").read_text())["ended"] is True  # node 1 must not read node 0 as lost


# Node 0's rank 1 when node 1 (rank 0) went: gloo reports the peer's closed socket.
GLOO_RESET_TAIL = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer [127.0.0.1]:40123\n"


@pytest.mark.parametrize("evidence", ["peer log", "rank result"])
def test_peer_killed_within_a_beat_of_the_first_steps_is_named_with_the_step(tmp_path, evidence):
    """Rank 0 ran on node 1, which was killed before a heartbeat carried a step: node 0 reads the
    step from node 1's job log in the shared folder, or from its own rank's result. Before the fix
    the reason was the store or gloo error ('cannot reach the rendezvous ...', '... no rank result
    from node rank 1'): training counted as started only if this node's log or a heartbeat said so."""
    launch, clock, progress, watch = _two_node_folder(tmp_path)
    clock.now = 2.2
    _beat(tmp_path, 1, 2)  # no step yet
    watch()
    (tmp_path / "probe-node1.log").write_text("zeroplan-progress engine-ready t=6.9\nzeroplan-progress step=1 t=8.0\n"
                                              if evidence == "peer log" else "zeroplan-progress engine-ready t=6.9\n")
    (tmp_path / "probe.log").write_text("zeroplan-progress step=99 t=1.0\n")  # node 0's log of an earlier probe (ignored)
    (tmp_path / "node-0.json").write_text(json.dumps({"node_rank": 0, "started_unix": time.time() - 3600}))
    ranks = [{"rank": 1, "node_rank": 0, "status": "error", "optimizer_steps": 3}] if evidence == "rank result" else []
    clock.now = 3.0
    reason, lost = _reason(launch, tmp_path, watch, progress, STORE_LOST_TAIL if evidence == "peer log" else GLOO_RESET_TAIL, ranks)
    step = 1 if evidence == "peer log" else 3
    assert lost and reason == (
        f"node rank 1 was lost mid-training (last step seen: {step}): its agent's heartbeat (alive-node-1.json) has not changed "
        "for 6 s (agent killed or node lost); this node's job failed without it")


def test_progress_in_own_log_and_a_peer_that_ended_is_not_lost(tmp_path):
    """Rank 0 on this node (its progress lines in the log), node 1 ended its job cleanly: no node
    is named lost, the rendezvous error is not a start-up failure, the silent-node rule applies."""
    launch, clock, progress, watch = _two_node_folder(tmp_path)
    for line in ("zeroplan-progress engine-ready t=4.1", "zeroplan-progress step=1 t=5.0", "zeroplan-progress step=2 t=5.4"):
        progress(line)
    clock.now = 2.0
    _beat(tmp_path, 1, 2, ended=True)
    reason, lost = _reason(launch, tmp_path, watch, progress, STORE_LOST_TAIL, ranks=[{"rank": 0, "node_rank": 0, "status": "error"}])
    assert not lost and reason == "torchrun failed; 2 of 2 ranks wrote no result (exit code 1); no rank result from node rank 1"
    assert clock.now == 2.0  # node 1 had ended: nothing to wait for
    assert watch.last_step == 2


def test_heartbeat_watch_names_a_node_lost_mid_training_while_the_job_runs(tmp_path):
    launch, clock, progress, watch = _two_node_folder(tmp_path)
    progress("zeroplan-progress step=40 t=12.0")
    clock.now = 2.0
    _beat(tmp_path, 1, 2)
    assert watch() is None
    clock.now = 8.0
    assert watch() is None  # silent for exactly stale_s: not yet
    clock.now = 10.0
    assert watch() == ("node rank 1 was lost mid-training (last step seen: 40): its agent's heartbeat (alive-node-1.json) "
                       "has not changed for 8 s (agent killed or node lost); this node's job was stopped")
    assert json.loads((tmp_path / "alive-node-0.json").read_text())["step"] == 40


def test_node_layout_is_checked():
    assert check_node_layout(gpus=8, nnodes=2, gpus_per_node=4) == 4
    assert check_node_layout(gpus=8, nnodes=2, gpus_per_node=None) == 4
    with pytest.raises(SpecError, match=r"--gpus 6 is not --nnodes 2 × --gpus-per-node 4 = 8"):
        check_node_layout(gpus=6, nnodes=2, gpus_per_node=4)
    with pytest.raises(SpecError, match="does not split evenly"):
        check_node_layout(gpus=5, nnodes=2, gpus_per_node=None)
    with pytest.raises(SpecError, match="--node-rank 2 is not valid for --nnodes 2"):
        NodeLaunch(nnodes=2, node_rank=2, rdzv_endpoint="h:29500")
    with pytest.raises(SpecError, match="--rdzv-endpoint 'h' is not valid"):
        NodeLaunch(nnodes=2, node_rank=0, rdzv_endpoint="h")


@pytest.mark.parametrize(
    "extra, slurm, needle",
    [
        (["--gpus", "6", "--gpus-per-node", "4", "--nnodes", "2"], None, "--gpus 6 is not --nnodes 2 × --gpus-per-node 4 = 8"),
        (["--gpus", "2", "--nnodes", "2", "--rdzv-endpoint", "localhost:29500"], None, "needs --node-rank"),
        (["--gpus", "2", "--nnodes", "2", "--node-rank", "0"], None, "needs --rdzv-endpoint"),
        (["--gpus", "2", "--nnodes", "2", "--launcher", "slurm"], None, "SLURM_JOB_ID is not set"),
        (["--gpus", "2", "--nnodes", "2", "--launcher", "slurm"], "localhost", "Slurm job 4242 has 1 node (localhost)"),
        (["--gpus", "2", "--nnodes", "2", "--launcher", "mpi"], None, "--launcher mpi is not valid"),
    ],
)
def test_bad_node_input_exits_2_with_one_line(tmp_path, extra, slurm, needle):
    env = _slurm_env(tmp_path, nodelist=slurm) if slurm else _env()
    r = _zeroplan("probe", str(TASK), "--stage", "3", "--workdir", str(tmp_path / "w"), *extra, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "w").exists()  # nothing launched, nothing written


# --- two torchrun agents as two nodes (slow) ------------------------------------------------


def _agent(rank: int, port: int, workdir: Path, *extra: str, env=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "zeroplan", "probe", str(TASK), "--backend", "fsdp", "--stage", "3", "--gpus", "2",
         "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"localhost:{port}", "--workdir", str(workdir),
         "--format", "json", *extra],
        cwd=ROOT, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.mark.slow
def test_two_agents_probe_zero3_and_both_see_every_rank(tmp_path):
    port = _free_port()
    agents = [_agent(k, port, tmp_path / "w") for k in (0, 1)]
    outs = [a.communicate(timeout=240) for a in agents]
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    results = [json.loads(out) for out, _ in outs]
    for r in results:
        assert r["status"] == "ok" and r["world_size"] == 2
        assert sorted(r["node_per_rank"]) == [0, 1]  # one rank from each node
        assert len(r["peak_memory_per_rank"]) == 2 and all(p > 0 for p in r["peak_memory_per_rank"])
        assert len(r["step_time_per_rank"]) == 2 and all(t > 0 for t in r["step_time_per_rank"])
    # Both agents read the same per-rank files from the shared folder.
    assert results[0]["peak_memory_per_rank"] == results[1]["peak_memory_per_rank"]
    per_rank = {json.loads(p.read_text())["rank"]: json.loads(p.read_text()) for p in (tmp_path / "w").glob("rank-*.json")}
    assert [per_rank[k]["peak_memory"] for k in (0, 1)] == results[0]["peak_memory_per_rank"]


@pytest.mark.slow
@pytest.mark.e2e
def test_killing_one_agent_fails_the_probe_and_leaves_nothing(tmp_path, request):
    import psutil

    port = _free_port()
    # Many steps: the probe is mid-training when node 1's agent is SIGKILLed.
    env = _env(ZEROPLAN_NODE_STALE_S="6")
    agents = [_agent(k, port, tmp_path / "w", "--steps", "100000", "--timeout", "300", env=env) for k in (0, 1)]
    # A failed assertion must not leave the agents training until --timeout (their torchruns and
    # workers die with them: zeroplan.runtime.launch.job._die_with_parent).
    request.addfinalizer(lambda: [a.kill() for a in agents if a.poll() is None])
    seen: set[int] = set()
    deadline = time.monotonic() + 180  # start-up (imports, engine) passed 120 s at load ~20 on 2 cores
    workers = []
    while time.monotonic() < deadline and len(workers) < 2:
        for a in agents:
            try:
                for c in psutil.Process(a.pid).children(recursive=True):
                    seen.add(c.pid)
            except psutil.Error:
                pass
        workers = [p for p in seen if _alive(p) and "zeroplan.runtime.rank.worker" in " ".join(psutil.Process(p).cmdline())]
        time.sleep(0.2)
    assert len(workers) == 2, "both nodes' workers should be running"
    # Into the training steps: rank 0's progress lines (runtime.measure.meter.PROGRESS_PREFIX) reach the
    # job logs under the workdir; a kill before the rendezvous completes is another test's case.
    def stepping() -> bool:
        return any("zeroplan-progress step=" in f.read_text(errors="replace") for f in (tmp_path / "w").rglob("*.log"))

    while time.monotonic() < deadline and not stepping():
        time.sleep(0.2)
    assert stepping(), "rank 0 should report training steps"
    agents[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    out, err = agents[0].communicate(timeout=90)
    agents[1].wait(timeout=10)
    assert agents[0].returncode == 1, err[-3000:]
    result = json.loads(out)
    assert result["status"] == "error", result["error"]
    # Whether torchrun lost the c10d store (kept by node 1's agent) or gloo saw the peer go, the
    # reason names node rank 1 and the step training had reached (rank 0 may run on either node).
    m = re.match(r"node rank 1 was lost mid-training \(last step seen: (\d+)\): its agent's heartbeat \(alive-node-1.json\)", result["error"])
    assert m and int(m.group(1)) >= 1, result["error"]
    assert time.monotonic() - killed < 6 + 2 + 5 + 15  # stale limit + beat + kill grace + margin, far below --timeout
    assert _wait_dead(sorted(seen)) == []


@pytest.mark.slow
@pytest.mark.e2e
def test_node_that_never_joins_is_named(tmp_path):
    port = _free_port()
    started = time.monotonic()
    agent = _agent(0, port, tmp_path / "w", "--rdzv-timeout", "2", "--timeout", "60")
    out, err = agent.communicate(timeout=90)
    result = json.loads(out)
    assert agent.returncode == 1
    assert result["status"] == "error"
    assert result["error"] == f"the rendezvous at localhost:{port} timed out after 2 s: node rank 1 never joined (no launcher started there)"
    assert time.monotonic() - started < 40


# --- Slurm through a fake srun (slow) -------------------------------------------------------


# The Slurm launcher's successful end-to-end run is tests/test_zeropp.py's hpZ probe (4 ranks, 2 nodes).


@pytest.mark.slow
@pytest.mark.e2e
def test_slurm_timeout_cancels_the_step_everywhere(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = tmp_path / "hang_task.py"
    script.write_text(textwrap.dedent(HANG_TASK))
    env = _slurm_env(tmp_path, PID_DIR=str(pid_dir))
    started = time.monotonic()
    r = _zeroplan("probe", str(script), "--backend", "fsdp", "--stage", "3", "--gpus", "2", "--nnodes", "2", "--launcher", "slurm",
                  "--workdir", str(tmp_path / "w"), "--timeout", "20", "--format", "json", env=env)
    assert r.returncode == 1, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert result["status"] == "timeout" and "20 s" in result["error"]
    assert time.monotonic() - started < 20 + 30
    pids = [int(p) for f in pid_dir.glob("pid-*") for p in f.read_text().split()]
    step = json.loads(next((tmp_path / "slurm").glob("step-*.json")).read_text())
    assert len(pids) == 4, pids  # a worker and its grandchild on each node
    assert _wait_dead(pids + step["tasks"] + [step["stepd"]]) == []


# --- tune across nodes ----------------------------------------------------------------------


def test_tune_emit_sbatch_writes_a_runnable_batch_script(tmp_path):
    job = tmp_path / "job.sh"
    r = _zeroplan("tune", str(TASK), "--gpus", "16", "--nnodes", "2", "--backend", "fsdp", "--trials", "4",
                  "-o", str(tmp_path / "out"), "--time-budget", "3600", "--emit-sbatch", str(job), "--", "--layers", "2", env=_env())
    assert r.returncode == 0, r.stderr
    text = job.read_text()
    directives = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=zeroplan-tune", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
        "#SBATCH --exclusive", f"#SBATCH --output={tmp_path / 'out'}/slurm-%j.out", "#SBATCH --time=01:30:00",
    ]
    assert (tmp_path / "out").is_dir()  # sbatch opens --output there before the script runs
    assert subprocess.run(["bash", "-n", str(job)]).returncode == 0
    import shlex

    command = shlex.split(text.strip().splitlines()[-1])
    assert command[1:4] == ["-m", "zeroplan", "tune"]
    head, tail = command[: command.index("--")], command[command.index("--"):]
    assert "--emit-sbatch" not in head and head[head.index("--launcher") + 1] == "slurm" and "--resume" in head
    assert head[head.index("--storage") + 1] == str(tmp_path / "out" / "study.journal")
    assert tail == ["--", "--layers", "2"]


@pytest.mark.parametrize(
    "extra, slurm, needle",
    [
        (["--nnodes", "2", "--rdzv-endpoint", "h:29500"], None, "needs --node-rank"),
        (["--nnodes", "2", "--launcher", "slurm"], None, "SLURM_JOB_ID is not set"),
        (["--nnodes", "3", "--launcher", "slurm"], "localhost,127.0.0.1", "--nnodes 3 but Slurm job 4242 has 2 nodes"),
    ],
)
def test_tune_bad_node_input_exits_2_before_the_study_opens(tmp_path, extra, slurm, needle):
    env = _slurm_env(tmp_path, nodelist=slurm) if slurm else _env()
    gpus = str(2 * int(extra[1]))
    r = _zeroplan("tune", str(TASK), "--gpus", gpus, "-o", str(tmp_path / "out"), *extra, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.e2e
def test_tune_across_two_torchrun_nodes_leader_and_follower(tmp_path):
    """Node 0 tunes; node 1 follows every probe it starts, then stops when node 0 is done."""
    port = _free_port()
    common = [str(TASK), "--gpus", "2", "--nnodes", "2", "--rdzv-endpoint", f"localhost:{port}", "--backend", "fsdp",
              "--trials", "1", "--stage", "3", "--global-batch", "8", "-o", str(tmp_path / "out")]
    procs = [subprocess.Popen([sys.executable, "-m", "zeroplan", "tune", *common, "--node-rank", str(k)], cwd=ROOT, env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in (0, 1)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert procs[0].returncode == 0, outs[0][0][-2000:] + outs[0][1][-2000:]
    assert procs[1].returncode == 0, outs[1][1][-2000:]
    assert "node 1: node 0's tuner is done; joined 1 probes" in outs[1][0]
    (trial,) = (tmp_path / "out" / "probes").glob("trial-*")
    result = json.loads((trial / "result.json").read_text())
    assert result["status"] == "ok" and sorted(result["node_per_rank"]) == [0, 1]
