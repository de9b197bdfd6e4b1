"""``--launcher torchrun``: ``torchrun --standalone`` on one node; across nodes one zeroplan agent per
node, each running torchrun against a c10d rendezvous (zeroplan.runtime.launch.multinode)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import ClassVar, Optional

from zeroplan.runtime.launch import multinode
from zeroplan.runtime.launch.job import Job
from zeroplan.runtime.launch.base import LaunchFiles, LaunchHandle, LaunchJob, Launcher
from zeroplan.spec import SpecError

__all__ = ["TorchrunLauncher", "start_command", "torchrun_command"]

#: torchrun arguments that place a job across nodes: with any of them the user's own rendezvous is kept.
_NODE_ARGS = ("--nnodes", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr")


def torchrun_command(nproc: int, spec_path: Path, node_args: list[str]) -> list[str]:
    """``python -m torch.distributed.run ... -m zeroplan.runtime.rank.worker SPEC`` (no restarts: a
    failed probe is an answer, not something to retry)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts", "0"]
    return cmd + node_args + ["-m", "zeroplan.runtime.rank.worker", str(spec_path)]


def start_command(launcher: Launcher, job: LaunchJob, cmd: list[str], info: dict, *, started_at: float, heartbeats: bool) -> LaunchHandle:
    """Write ``cmd`` into the launcher's command file and start it as a :class:`Job` streaming into
    its log; ``heartbeats``: this node's agent beats and watches its peers' (multinode.NodeWatch)."""
    files = launcher.files(job.workdir, job.node_rank)
    files.command.write_text(" ".join(cmd) + "\n")
    progress = job.on_line if isinstance(job.on_line, multinode.ProgressTracker) else multinode.ProgressTracker(job.on_line)
    process = Job(cmd, dict(job.env), job.cwd, files.log, progress)
    watch = multinode.NodeWatch(job.workdir, job.nodes, progress=progress) if heartbeats and job.nodes is not None else None
    return LaunchHandle(launcher=launcher, job=job, process=process, started_at=started_at, info=info, watch=watch)


class TorchrunLauncher(Launcher):
    """torchrun on this node: ``--standalone`` alone, or this node's agent of a c10d rendezvous."""

    name: ClassVar[str] = "torchrun"
    help: ClassVar[str] = "torchrun --standalone; several nodes: one zeroplan agent per node, c10d rendezvous"
    spans_nodes = True
    agent_per_node = True

    def check_nodes(self, nodes) -> None:
        if nodes.nnodes == 1:
            if nodes.node_rank not in (None, 0) or nodes.rdzv_endpoint is not None:
                raise SpecError("--node-rank/--rdzv-endpoint are for --nnodes > 1 (one node runs torchrun --standalone)")
            return
        if nodes.node_rank is None:
            raise SpecError(
                f"--nnodes {nodes.nnodes} with --launcher {self.name} needs --node-rank K (0..{nodes.nnodes - 1}): "
                "start one agent per node, each with its own --node-rank"
            )
        if isinstance(nodes.node_rank, bool) or not 0 <= nodes.node_rank < nodes.nnodes:
            raise SpecError(
                f"--node-rank {nodes.node_rank} is not valid for --nnodes {nodes.nnodes}; give 0..{nodes.nnodes - 1} "
                "(start one agent per node, each with its own --node-rank)"
            )
        if nodes.rdzv_endpoint is None:
            raise SpecError(f"--nnodes {nodes.nnodes} with --launcher {self.name} needs --rdzv-endpoint HOST:PORT (a free port on node 0)")
        multinode.check_endpoint(nodes.rdzv_endpoint)

    def peer_start_skew_s(self, nodes) -> float:
        # Another node's agent may have started up to one rendezvous timeout before this one.
        return nodes.rdzv_timeout_s

    def files(self, workdir: Path, node_rank: Optional[int] = None) -> LaunchFiles:
        # One file set per node agent in a shared folder; node 0 keeps the plain names.
        tag = f"-node{node_rank}" if node_rank else ""
        return LaunchFiles(log=workdir / multinode.job_log_name(node_rank), command=workdir / f"command{tag}.txt",
                           result=workdir / f"result{tag}.json")

    @staticmethod
    def local_command(nproc: int, spec_path: Path, torchrun_args: tuple[str, ...] = ()) -> list[str]:
        """One node: ``--standalone`` (a c10d store on a free localhost port, so concurrent probes
        never fight over MASTER_PORT) unless the user's torchrun arguments place the job themselves."""
        standalone = [] if any(a.split("=")[0] in _NODE_ARGS for a in torchrun_args) else ["--standalone"]
        return torchrun_command(nproc, spec_path, standalone + list(torchrun_args))

    def node_command(self, nodes, *, nproc: int, spec_path: Path, workdir: Path, env: dict[str, str] | None = None) -> tuple[list[str], dict]:
        """This node's wrapper (``zeroplan.runtime.launch.node_start`` writes its marker, then execs
        torchrun) and torchrun against the user's rendezvous endpoint; (command, info)."""
        rdzv_id = nodes.rdzv_id or multinode.rendezvous_id(workdir)
        endpoint = str(nodes.rdzv_endpoint)
        wrapper = [sys.executable, "-m", "zeroplan.runtime.launch.node_start", str(workdir), str(nodes.node_rank)]
        torchrun = torchrun_command(nproc, spec_path, multinode.torchrun_node_args(nodes, endpoint=endpoint, rdzv_id=rdzv_id))
        return wrapper + ["--"] + torchrun, {"rdzv_id": rdzv_id, "endpoint": endpoint}

    def start(self, job: LaunchJob) -> LaunchHandle:
        started_at = time.monotonic()
        across = job.nodes is not None and job.nodes.multinode
        if across:
            cmd, info = self.node_command(job.nodes, nproc=job.nproc, spec_path=job.spec_path, workdir=job.spec_path.parent)
        else:
            cmd, info = self.local_command(job.nproc, job.spec_path, job.torchrun_args), {}
        return start_command(self, job, cmd, info, started_at=started_at, heartbeats=across)
