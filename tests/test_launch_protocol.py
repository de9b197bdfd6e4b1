"""The launcher protocol (zeroplan.runtime.launch): every registered kind keeps the contract, a new
kind is one class and one registry entry that run_probe, ProbeRequest and --launcher then accept,
and no code outside the launch package compares a kind's name."""

from __future__ import annotations

import ast
import sys
import time
from pathlib import Path

import pytest

from zeroplan.cli.nodes import local_launcher, resolve_nodes
from zeroplan.runtime import ProbeRequest, run_probe
from zeroplan.runtime.launch import LAUNCHERS, LaunchHandle, LaunchJob, Launcher, launcher, launcher_for, local_launchers, node_launchers
from zeroplan.runtime.launch.torchrun import start_command
from zeroplan.runtime.launch.multinode import NodeLaunch, job_log_name
from zeroplan.spec import Plan, SpecError, TrainingSpec

from helpers import ROOT

TASK = ROOT / "examples" / "gpt_task.py"


# --- every registered kind ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(LAUNCHERS))
def test_every_registered_kind_keeps_the_contract(name, tmp_path):
    cls = LAUNCHERS[name]
    kind = launcher(name)
    assert isinstance(kind, Launcher) and cls.name == name and cls.help
    assert cls.one_node or cls.spans_nodes, "a kind must run one node's ranks, or a probe across nodes"
    assert not cls.scheduled or cls.spans_nodes
    for node_rank in (None, 0, 1, 3):
        files = kind.files(tmp_path, node_rank)
        paths = (files.log, files.command, files.result)
        assert len(set(paths)) == 3 and all(p.parent == tmp_path for p in paths)
    if cls.fallback is not None:
        assert cls.fallback.name in local_launchers(), "a fallback must start one node's ranks"
    if not cls.one_node:
        assert cls.one_node_launcher is not None and cls.one_node_launcher.name in local_launchers()
    assert local_launcher(name) in local_launchers()


def test_agents_on_other_nodes_and_readers_of_their_logs_agree_on_file_names(tmp_path):
    """multinode.logged_step reads peers' logs by job_log_name; the launcher must write them there."""
    torchrun = launcher("torchrun")
    for k in (0, 1, 5):
        assert torchrun.files(tmp_path, k).log == tmp_path / job_log_name(k)
    # Files that differ per node exist only where every node runs its own agent in one folder.
    for name, cls in LAUNCHERS.items():
        if not cls.agent_per_node:
            assert launcher(name).files(tmp_path, 1) == launcher(name).files(tmp_path, None)


def test_which_launcher_runs_a_request():
    assert launcher_for(ProbeRequest(script=TASK)).warm
    assert not launcher_for(ProbeRequest(script=TASK, torchrun_args=("--max-restarts=0",))).warm  # torchrun's arguments need torchrun
    two = NodeLaunch(nnodes=2, launcher="torchrun", node_rank=1, rdzv_endpoint="h:29500")
    assert launcher_for(ProbeRequest(script=TASK, nodes=two)).agent_per_node
    slurm_one = NodeLaunch(nnodes=1, launcher="slurm")
    assert slurm_one.multinode and launcher_for(ProbeRequest(script=TASK, nodes=slurm_one)).scheduled
    assert not NodeLaunch(nnodes=1, launcher="torchrun").multinode
    assert launcher("torchrun").peer_start_skew_s(two) == two.rdzv_timeout_s


# --- a new kind: one class, one registry entry ----------------------------------------------


class EchoLauncher(Launcher):
    """A kind the project does not ship: runs a plain command instead of the ranks."""

    name = "echo"
    help = "runs a command (test kind)"
    command: list[str] = []
    cancelled: list[LaunchHandle] = []

    def start(self, job: LaunchJob) -> LaunchHandle:
        return start_command(self, job, self.command, {}, started_at=time.monotonic(), heartbeats=False)

    def cancel(self, handle: LaunchHandle) -> None:
        EchoLauncher.cancelled.append(handle)
        super().cancel(handle)


@pytest.fixture
def echo(monkeypatch):
    monkeypatch.setitem(LAUNCHERS, "echo", EchoLauncher)
    EchoLauncher.cancelled = []
    return EchoLauncher


def _echo_probe(tmp_path: Path, timeout_s: float):
    return run_probe(ProbeRequest(script=TASK, nproc=1, plan=Plan(stage=1), training=TrainingSpec(seq_len=32), steps=1, warmup=0,
                                  timeout_s=timeout_s, workdir=tmp_path, launcher="echo"))


def test_a_registered_kind_runs_probes_and_writes_its_files(tmp_path, echo):
    echo.command = [sys.executable, "-c", "print('echo ran', flush=True); raise SystemExit(3)"]
    result = _echo_probe(tmp_path, timeout_s=60)
    assert result.launcher == "echo" and result.launcher_note is None
    assert result.status == "error" and "exit code 3" in result.error, result.error
    assert "echo ran" in result.log_tail and "echo ran" in (tmp_path / "probe.log").read_text()
    assert (tmp_path / "command.txt").read_text().strip().endswith("raise SystemExit(3)")
    assert (tmp_path / "result.json").exists()
    assert len(echo.cancelled) == 1  # a failed job is stopped through its launcher


def test_a_registered_kind_is_cancelled_on_timeout(tmp_path, echo):
    echo.command = [sys.executable, "-c", "import time; time.sleep(60)"]
    started = time.monotonic()
    result = _echo_probe(tmp_path, timeout_s=1.5)
    assert result.status == "timeout" and len(echo.cancelled) == 1
    assert echo.cancelled[0].process.proc.poll() is not None and time.monotonic() - started < 30


def test_a_registered_kind_is_a_launcher_choice(echo):
    assert "echo" in local_launchers() and "echo" not in node_launchers()
    assert local_launcher("echo") == "echo"
    with pytest.raises(SpecError, match="--launcher echo starts the ranks of one node; with --nnodes 2 use --launcher torchrun or --launcher slurm"):
        resolve_nodes(gpus=4, gpus_per_node=None, nnodes=2, launcher="echo", node_rank=0, rdzv_endpoint="h:29500", rdzv_timeout=120)
    with pytest.raises(SpecError, match="--launcher k8s is not valid; choose one of warm, torchrun, slurm, echo"):
        resolve_nodes(gpus=2, gpus_per_node=None, nnodes=1, launcher="k8s", node_rank=None, rdzv_endpoint=None, rdzv_timeout=120)


# --- the kind's name is compared in one place -------------------------------------------------


def _string_constants(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def test_no_code_outside_the_launch_package_compares_a_launcher_name():
    """Callers ask the launcher (its attributes and methods) instead of `launcher == "slurm"`.
    node_start's ``slurm`` is its own argument (take the node rank from SLURM_NODEID), not a kind."""
    names = set(LAUNCHERS)
    allowed = (ROOT / "zeroplan" / "runtime" / "launch",)
    found = []
    for path in sorted((ROOT / "zeroplan").rglob("*.py")):
        if any(path == a or a in path.parents for a in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and _string_constants(node) & names:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []
