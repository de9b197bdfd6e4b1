"""Probes across nodes: torchrun c10d rendezvous (one zeroplan agent per node) or one Slurm step.

* ``torchrun``: the user starts ``zeroplan probe ... --nnodes N --node-rank K --rdzv-endpoint
  HOST:PORT`` on every node; each agent runs one ``torchrun --nnodes N --rdzv-backend c10d`` and
  the ranks meet at the endpoint (torch/distributed/run.py; c10d assigns the ranks, the user's
  ``--node-rank`` names the agent in zeroplan's messages).
* ``slurm``: inside an allocation (``salloc``/``sbatch``) one agent runs each probe as one job
  step, ``srun --nodes N --ntasks-per-node 1 torchrun ...``, with the rendezvous on the first
  node of ``SLURM_JOB_NODELIST``. No ssh, no pdsh, no hostfile. A timeout stops the step the
  way Slurm does: SIGTERM to ``srun`` (forwarded to every task), then ``scancel`` of the step.

Every node's ranks write their results into the probe folder, so on a real cluster that folder
(``--workdir``, or the tune output) must be on a file system all nodes share. Each node's
launcher first writes ``node-<K>.json`` there; a rendezvous that times out names the node ranks
with no such file.

Slurm itself (allocation, step cancel, batch script) lives in :mod:`zeroplan.runtime.slurm`.
No torch here; ``python -m zeroplan.runtime.node_start`` is the small per-node wrapper that
writes the marker and then *execs* torchrun (same pid, so signals that reach it reach torchrun).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from zeroplan.runtime.slurm import (
    SlurmAllocation,
    cancel_slurm_step,
    expand_hostlist,
    sbatch_script,
    slurm_allocation,
    tune_command_for_sbatch,
)
from zeroplan.spec import SpecError

__all__ = [
    "LAUNCHERS",
    "NodeLaunch",
    "SlurmAllocation",
    "check_node_layout",
    "expand_hostlist",
    "slurm_allocation",
    "torchrun_node_args",
    "node_command",
    "missing_nodes",
    "rendezvous_failure",
    "cancel_slurm_step",
    "NodeWatch",
    "sbatch_script",
    "tune_command_for_sbatch",
]

#: How a probe is launched.
LAUNCHERS = ("torchrun", "slurm")
#: Seconds torchrun waits for all nodes at the rendezvous (c10d ``join_timeout``) by default.
DEFAULT_RDZV_TIMEOUT_S = 120.0
#: Seconds between heartbeats of a torchrun node agent in the shared probe folder.
HEARTBEAT_INTERVAL_S = 2.0
#: Seconds without a new heartbeat after which a node that was beating counts as gone
#: (``ZEROPLAN_NODE_STALE_S`` overrides; network file systems can show updates late).
DEFAULT_NODE_STALE_S = 30.0
#: Ports tried for the Slurm rendezvous on the first node (one drawn per probe).
SLURM_RDZV_PORTS = range(29500, 29999)

_ENDPOINT_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@dataclass(frozen=True)
class NodeLaunch:
    """How a probe spans nodes (absent: one node, ``torchrun --standalone`` as before)."""

    nnodes: int = 1
    """Nodes in the job (``torchrun --nnodes``, ``srun --nodes``)."""
    launcher: str = "torchrun"
    """``torchrun`` (one zeroplan agent per node, c10d rendezvous) or ``slurm`` (one srun step)."""
    node_rank: int | None = None
    """torchrun launcher: the node this agent runs on, 0..nnodes-1 (names it in messages)."""
    rdzv_endpoint: str | None = None
    """torchrun launcher: ``HOST:PORT`` of the c10d rendezvous (a port free on HOST, node 0 usually)."""
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    """Seconds to wait for every node at the rendezvous before giving up."""
    rdzv_id: str | None = None
    """Rendezvous id shared by all agents of one probe (default: derived from the probe folder)."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise SpecError(f"--launcher {self.launcher} is not valid; choose one of {', '.join(LAUNCHERS)}")
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise SpecError(f"--nnodes {self.nnodes!r} is not valid; give a whole number >= 1")
        if not self.rdzv_timeout_s > 0:
            raise SpecError(f"--rdzv-timeout {self.rdzv_timeout_s!r} is not valid; give seconds > 0")
        if self.launcher == "slurm":
            if self.node_rank is not None or self.rdzv_endpoint is not None:
                raise SpecError("--launcher slurm picks node ranks and the rendezvous itself; drop --node-rank/--rdzv-endpoint")
            return
        if self.nnodes == 1:
            if self.node_rank not in (None, 0) or self.rdzv_endpoint is not None:
                raise SpecError("--node-rank/--rdzv-endpoint are for --nnodes > 1 (one node runs torchrun --standalone)")
            return
        if self.node_rank is None:
            raise SpecError(
                f"--nnodes {self.nnodes} with --launcher torchrun needs --node-rank K (0..{self.nnodes - 1}): "
                "start one agent per node, each with its own --node-rank"
            )
        if isinstance(self.node_rank, bool) or not 0 <= self.node_rank < self.nnodes:
            raise SpecError(
                f"--node-rank {self.node_rank} is not valid for --nnodes {self.nnodes}; give 0..{self.nnodes - 1} "
                "(start one agent per node, each with its own --node-rank)"
            )
        if self.rdzv_endpoint is None:
            raise SpecError(f"--nnodes {self.nnodes} with --launcher torchrun needs --rdzv-endpoint HOST:PORT (a free port on node 0)")
        m = _ENDPOINT_RE.match(self.rdzv_endpoint)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise SpecError(f"--rdzv-endpoint {self.rdzv_endpoint!r} is not valid; give HOST:PORT, e.g. node001:29500")

    @property
    def multinode(self) -> bool:
        """More than one node, or a Slurm step (which runs through srun even on one node)."""
        return self.nnodes > 1 or self.launcher == "slurm"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_node_layout(*, gpus: int, nnodes: int, gpus_per_node: int | None) -> int:
    """GPUs per node for ``--gpus`` on ``--nnodes`` (``--gpus`` must be nodes × GPUs per node).

    Returns the processes each node starts; raises SpecError naming the three numbers otherwise.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise SpecError(f"--gpus {gpus} is not valid; give at least 1")
    if nnodes < 1:
        raise SpecError(f"--nnodes {nnodes} is not valid; give at least 1")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise SpecError(f"--gpus-per-node {gpus_per_node} is not valid; give at least 1")
    if nnodes == 1:
        return min(gpus, gpus_per_node) if gpus_per_node else gpus
    if gpus_per_node is None:
        if gpus % nnodes:
            raise SpecError(f"--gpus {gpus} does not split evenly over --nnodes {nnodes}; give --gpus as nodes × GPUs per node")
        return gpus // nnodes
    if gpus != nnodes * gpus_per_node:
        raise SpecError(
            f"--gpus {gpus} is not --nnodes {nnodes} × --gpus-per-node {gpus_per_node} = {nnodes * gpus_per_node}; "
            "give --gpus equal to nodes × GPUs per node"
        )
    return gpus_per_node


# --- commands ---------------------------------------------------------------------------------


def rendezvous_id(workdir: Path) -> str:
    """Same on every node for one probe folder (agents are started with the same ``--workdir``)."""
    return "zeroplan-" + hashlib.sha1(str(workdir).encode()).hexdigest()[:12]


def torchrun_node_args(launch: NodeLaunch, *, endpoint: str, rdzv_id: str) -> list[str]:
    """torchrun's multi-node arguments: fixed node count, c10d rendezvous, bounded join wait."""
    return [
        "--nnodes",
        str(launch.nnodes),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"join_timeout={int(round(launch.rdzv_timeout_s))}",
    ]


def node_command(
    launch: NodeLaunch, *, nproc: int, spec_path: Path, workdir: Path, env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """(command, extra info) for a multi-node probe.

    torchrun launcher: this node's wrapper + torchrun. Slurm: ``srun`` of the wrapper on every
    node, the rendezvous on the allocation's first host. The info dict records the endpoint and,
    for Slurm, the step name (for ``scancel``).
    """
    rdzv_id = launch.rdzv_id or rendezvous_id(workdir)
    info: dict[str, str] = {"rdzv_id": rdzv_id}
    if launch.launcher == "slurm":
        alloc = slurm_allocation(launch.nnodes, env)
        endpoint = f"{alloc.hosts[0]}:{random.choice(SLURM_RDZV_PORTS)}"
        step_name = f"zeroplan-{rdzv_id[-12:]}-{os.getpid()}-{int(time.time() * 1000) % 10**6}"
        info.update(endpoint=endpoint, step_name=step_name, job_id=alloc.job_id, hosts=",".join(alloc.hosts[: launch.nnodes]))
        srun = [
            "srun",
            "--nodes",
            str(launch.nnodes),
            "--ntasks",
            str(launch.nnodes),
            "--ntasks-per-node",
            "1",
            "--kill-on-bad-exit=1",
            f"--job-name={step_name}",
            "--export=ALL",
        ]
        wrapper = [sys.executable, "-m", "zeroplan.runtime.node_start", str(workdir), "slurm"]
    else:
        endpoint = str(launch.rdzv_endpoint)
        info["endpoint"] = endpoint
        srun = []
        wrapper = [sys.executable, "-m", "zeroplan.runtime.node_start", str(workdir), str(launch.node_rank)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts", "0"]
    torchrun += torchrun_node_args(launch, endpoint=endpoint, rdzv_id=rdzv_id)
    torchrun += ["-m", "zeroplan.runtime.worker", str(spec_path)]
    return srun + wrapper + ["--"] + torchrun, info


# --- what came back ---------------------------------------------------------------------------


def read_node_markers(workdir: Path, *, since_unix: float) -> dict[int, dict]:
    """``node-<K>.json`` markers written by this probe's node launchers (not older than ``since``)."""
    out: dict[int, dict] = {}
    for path in workdir.glob("node-*.json"):
        try:
            data = json.loads(path.read_text())
            if float(data.get("started_unix", 0)) >= since_unix:
                out[int(data["node_rank"])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def missing_nodes(workdir: Path, nnodes: int, *, since_unix: float) -> list[int]:
    """Node ranks whose launcher never started (no fresh marker in the shared probe folder)."""
    present = read_node_markers(workdir, since_unix=since_unix)
    return [k for k in range(nnodes) if k not in present]


_RDZV_FAIL = re.compile(r"RendezvousTimeoutError|RendezvousConnectionError|RendezvousClosedError")


def rendezvous_failure(log_text: str, *, launch: NodeLaunch, endpoint: str, missing: list[int]) -> str | None:
    """One line when the log shows the rendezvous failed (torchrun's RendezvousTimeoutError ...)."""
    m = _RDZV_FAIL.search(log_text)
    if not m:
        return None
    return nodes_message(m.group(0), launch=launch, endpoint=endpoint, missing=missing)


def nodes_message(what: str, *, launch: NodeLaunch, endpoint: str, missing: list[int]) -> str:
    head = {
        "RendezvousTimeoutError": f"the rendezvous at {endpoint} timed out after {launch.rdzv_timeout_s:g} s",
        "RendezvousConnectionError": f"cannot reach the rendezvous at {endpoint}",
        "RendezvousClosedError": f"the rendezvous at {endpoint} was closed",
    }.get(what, what)
    if missing:
        names = ", ".join(str(k) for k in missing)
        return f"{head}: node rank{'s' * (len(missing) > 1)} {names} never joined (no launcher started there)"
    return f"{head}: every node's launcher started, but not all reached the rendezvous"


class NodeWatch:
    """Heartbeats between torchrun node agents through the shared probe folder.

    A node whose agent dies mid-probe (killed, or its machine lost) leaves the other nodes'
    ranks waiting in a collective or in gloo's connect loop until the probe timeout; torchrun's
    elastic agent does not notice a node leaving. Each agent rewrites ``alive-node-<K>.json``
    every :data:`HEARTBEAT_INTERVAL_S`; a node whose file was seen changing and then stops
    changing for ``stale_s`` (measured on this node's clock: no clock skew between nodes)
    ends the probe here with a reason naming it. Calling the object does one round when due.
    """

    def __init__(self, workdir: Path, launch: NodeLaunch, *, stale_s: float | None = None, interval_s: float = HEARTBEAT_INTERVAL_S):
        self.workdir = workdir
        self.launch = launch
        self.interval_s = interval_s
        env_stale = os.environ.get("ZEROPLAN_NODE_STALE_S")
        self.stale_s = stale_s if stale_s is not None else float(env_stale) if env_stale else DEFAULT_NODE_STALE_S
        self._beats = 0
        self._next = 0.0
        self._seen: dict[int, tuple[str, float]] = {}  # node -> (last content, monotonic time it changed)
        self._started = time.monotonic()

    def __call__(self) -> str | None:
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + self.interval_s
        me = self.launch.node_rank or 0
        self._beats += 1
        path = self.workdir / f"alive-node-{me}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            tmp.write_text(json.dumps({"node_rank": me, "beat": self._beats, "pid": os.getpid(), "unix": time.time()}))
            os.replace(tmp, path)
        except OSError:
            pass
        for k in range(self.launch.nnodes):
            if k == me:
                continue
            try:
                text = (self.workdir / f"alive-node-{k}.json").read_text()
            except OSError:
                continue
            last = self._seen.get(k)
            if last is None:
                self._seen[k] = (text, -1.0)  # content from before: not a beat yet
            elif text != last[0]:
                self._seen[k] = (text, now)
            elif last[1] >= 0 and now - last[1] > self.stale_s:
                return (
                    f"node rank {k} stopped: its agent's heartbeat (alive-node-{k}.json) has not changed for "
                    f"{now - last[1]:.0f} s (agent killed or node lost); this node's job was stopped"
                )
        return None
