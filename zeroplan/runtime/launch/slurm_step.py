"""``--launcher slurm``: every probe is one job step inside the allocation, ``srun --nodes N
--ntasks-per-node 1`` of the node wrapper and torchrun, the rendezvous on the allocation's first
host (Slurm itself: zeroplan.runtime.launch.slurm). No ssh, no hostfile; one zeroplan agent for all nodes."""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import ClassVar

from zeroplan.runtime.launch import multinode
from zeroplan.runtime.launch.base import LaunchHandle, LaunchJob, Launcher
from zeroplan.runtime.launch.torchrun import TorchrunLauncher, start_command, torchrun_command
from zeroplan.runtime.launch.slurm import cancel_slurm_step, slurm_allocation
from zeroplan.spec import SpecError

__all__ = ["SLURM_RDZV_PORTS", "SlurmLauncher"]

#: Ports tried for the Slurm rendezvous on the first node (one drawn per probe).
SLURM_RDZV_PORTS = range(29500, 29999)


class SlurmLauncher(Launcher):
    """One ``srun`` step per probe; torchrun starts the ranks on each node."""

    name: ClassVar[str] = "slurm"
    help: ClassVar[str] = "one srun step per probe, inside salloc/sbatch"
    one_node = False
    spans_nodes = True
    scheduled = True
    one_node_launcher = TorchrunLauncher

    def check_nodes(self, nodes) -> None:
        if nodes.node_rank is not None or nodes.rdzv_endpoint is not None:
            raise SpecError(f"--launcher {self.name} picks node ranks and the rendezvous itself; drop --node-rank/--rdzv-endpoint")

    def preflight(self, nodes) -> None:
        slurm_allocation(nodes.nnodes)  # outside an allocation / too few nodes: one line, before anything is written

    def node_command(self, nodes, *, nproc: int, spec_path: Path, workdir: Path, env: dict[str, str] | None = None) -> tuple[list[str], dict]:
        """``srun`` of the wrapper on every node of the allocation, torchrun meeting on its first
        host; (command, info) with the step's name (for ``scancel``), job id and hosts."""
        rdzv_id = nodes.rdzv_id or multinode.rendezvous_id(workdir)
        alloc = slurm_allocation(nodes.nnodes, env)
        endpoint = f"{alloc.hosts[0]}:{random.choice(SLURM_RDZV_PORTS)}"
        step_name = f"zeroplan-{rdzv_id[-12:]}-{os.getpid()}-{int(time.time() * 1000) % 10**6}"
        info = {"rdzv_id": rdzv_id, "endpoint": endpoint, "step_name": step_name, "job_id": alloc.job_id,
                "hosts": ",".join(alloc.hosts[: nodes.nnodes])}
        srun = ["srun", "--nodes", str(nodes.nnodes), "--ntasks", str(nodes.nnodes), "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
                f"--job-name={step_name}", "--export=ALL"]
        wrapper = [sys.executable, "-m", "zeroplan.runtime.launch.node_start", str(workdir), "slurm"]
        torchrun = torchrun_command(nproc, spec_path, multinode.torchrun_node_args(nodes, endpoint=endpoint, rdzv_id=rdzv_id))
        return srun + wrapper + ["--"] + torchrun, info

    def start(self, job: LaunchJob) -> LaunchHandle:
        started_at = time.monotonic()
        cmd, info = self.node_command(job.nodes, nproc=job.nproc, spec_path=job.spec_path, workdir=job.spec_path.parent)
        return start_command(self, job, cmd, info, started_at=started_at, heartbeats=False)

    def cancel(self, handle: LaunchHandle) -> None:
        handle.process.kill_all()
        # The step's remote tasks are not our processes: srun forwarded the SIGTERM; scancel makes
        # Slurm kill whatever is left of the step on every node.
        if handle.info.get("step_name"):
            cancel_slurm_step(handle.info["step_name"], dict(handle.job.env))
