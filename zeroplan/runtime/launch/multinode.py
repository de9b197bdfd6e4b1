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

Slurm itself (allocation, step cancel, batch script) lives in :mod:`zeroplan.runtime.launch.slurm`.
No torch here; ``python -m zeroplan.runtime.launch.node_start`` is the small per-node wrapper that
writes the marker and then *execs* torchrun (same pid, so signals that reach it reach torchrun).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from zeroplan.runtime.measure.meter import progress_step
from zeroplan.runtime.launch.slurm import (
    SlurmAllocation,
    cancel_slurm_step,
    expand_hostlist,
    sbatch_script,
    slurm_allocation,
    tune_command_for_sbatch,
)
from zeroplan.spec import SpecError

__all__ = [
    "NodeLaunch",
    "SlurmAllocation",
    "check_endpoint",
    "check_node_layout",
    "expand_hostlist",
    "slurm_allocation",
    "torchrun_node_args",
    "node_command",
    "missing_nodes",
    "rendezvous_failure",
    "last_step_seen",
    "logged_step",
    "job_log_name",
    "lost_node_message",
    "ProgressTracker",
    "cancel_slurm_step",
    "NodeWatch",
    "sbatch_script",
    "tune_command_for_sbatch",
]

#: Seconds torchrun waits for all nodes at the rendezvous (c10d ``join_timeout``) by default.
DEFAULT_RDZV_TIMEOUT_S = 120.0
#: Seconds between heartbeats of a torchrun node agent in the shared probe folder.
HEARTBEAT_INTERVAL_S = 2.0
#: Seconds without a new heartbeat after which a node that was beating counts as gone
#: (``ZEROPLAN_NODE_STALE_S`` overrides; network file systems can show updates late).
DEFAULT_NODE_STALE_S = 30.0
#: Bytes read from the end of each node's job log when looking for rank 0's last progress line.
LOG_TAIL_BYTES = 256 * 1024

_ENDPOINT_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


@dataclass(frozen=True)
class NodeLaunch:
    """How a probe spans nodes (absent: one node, ``torchrun --standalone`` as before)."""

    nnodes: int = 1
    """Nodes in the job (``torchrun --nnodes``, ``srun --nodes``)."""
    launcher: str = "torchrun"
    """How the nodes start (``zeroplan.runtime.launch.node_launchers()``): ``torchrun`` (one zeroplan
    agent per node, c10d rendezvous) or ``slurm`` (one srun step)."""
    node_rank: int | None = None
    """torchrun launcher: the node this agent runs on, 0..nnodes-1 (names it in messages)."""
    rdzv_endpoint: str | None = None
    """torchrun launcher: ``HOST:PORT`` of the c10d rendezvous (a port free on HOST, node 0 usually)."""
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    """Seconds to wait for every node at the rendezvous before giving up."""
    rdzv_id: str | None = None
    """Rendezvous id shared by all agents of one probe (default: derived from the probe folder)."""

    def __post_init__(self) -> None:
        from zeroplan.runtime.launch.registry import node_launchers  # the registry's kinds import this module

        if self.launcher not in node_launchers():
            raise SpecError(f"--launcher {self.launcher} is not valid; choose one of {', '.join(node_launchers())}")
        if isinstance(self.nnodes, bool) or not isinstance(self.nnodes, int) or self.nnodes < 1:
            raise SpecError(f"--nnodes {self.nnodes!r} is not valid; give a whole number >= 1")
        if not self.rdzv_timeout_s > 0:
            raise SpecError(f"--rdzv-timeout {self.rdzv_timeout_s!r} is not valid; give seconds > 0")
        self.kind.check_nodes(self)

    @property
    def kind(self):
        """The :class:`~zeroplan.runtime.launch.base.Launcher` that runs this layout."""
        from zeroplan.runtime.launch.registry import launcher

        return launcher(self.launcher)

    @property
    def multinode(self) -> bool:
        """More than one node, or a scheduler's job step (a Slurm step runs through srun even on one node)."""
        return self.nnodes > 1 or self.kind.scheduled

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


def check_endpoint(endpoint: str) -> None:
    """SpecError unless ``endpoint`` is ``HOST:PORT`` with a port in 1..65535."""
    m = _ENDPOINT_RE.match(endpoint)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise SpecError(f"--rdzv-endpoint {endpoint!r} is not valid; give HOST:PORT, e.g. node001:29500")


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
    """(command, extra info) for a multi-node probe, from its launcher (zeroplan.runtime.launch):
    torchrun, this node's wrapper + torchrun; Slurm, ``srun`` of the wrapper on every node, the
    rendezvous on the allocation's first host. The info records the endpoint and, for Slurm, the
    step name (for ``scancel``)."""
    return launch.kind.node_command(launch, nproc=nproc, spec_path=spec_path, workdir=workdir, env=env)


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


def last_step_seen(log_text: str, heartbeats: dict[int, dict] | None = None) -> int | None:
    """The last optimizer step a probe reached: rank 0's progress lines in this node's log
    (``zeroplan-progress step=N``; rank 0 may run on any node) or the ``step`` the node agents'
    heartbeats carry. None: training never started, as far as this node can see."""
    steps = [s for s in map(progress_step, log_text.splitlines()) if s is not None]
    steps += [int(h["step"]) for h in (heartbeats or {}).values() if isinstance(h.get("step"), int)]
    return max(steps) if steps else None


def job_log_name(node_rank: int | None) -> str:
    """A node launcher's job log in the probe folder: ``probe.log`` on node 0 (and for a Slurm
    step, whose one launcher logs every node), ``probe-node<K>.log`` on node K."""
    return f"probe-node{node_rank}.log" if node_rank else "probe.log"


def logged_step(workdir: Path, nnodes: int, *, since_unix: float, tail_bytes: int = LOG_TAIL_BYTES) -> int | None:
    """The last optimizer step rank 0 printed into any node's job log in the shared probe folder.

    Rank 0's progress lines reach only the log of the node c10d put it on, and a heartbeat
    carries them up to one beat late, so a node killed right after the first steps leaves them
    only in its log. Logs of nodes with no fresh marker (:func:`read_node_markers`) are from an
    earlier probe in the same folder and are skipped.
    """
    steps = []
    for k in sorted(read_node_markers(workdir, since_unix=since_unix)):
        if not 0 <= k < nnodes:
            continue
        try:
            with (workdir / job_log_name(k)).open("rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(f.tell() - tail_bytes, 0))
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        step = last_step_seen(text)
        if step is not None:
            steps.append(step)
    return max(steps) if steps else None


def rendezvous_failure(
    log_text: str,
    *,
    launch: NodeLaunch,
    endpoint: str,
    missing: list[int],
    last_step: int | None = None,
) -> str | None:
    """One line when the log shows the rendezvous failed at start-up (torchrun's
    RendezvousTimeoutError ...); None otherwise.

    Once training has started (:func:`last_step_seen`), a rendezvous error is not a start-up
    failure: torchrun's elastic agent keeps polling the c10d store during training
    (``num_nodes_waiting`` in torch/distributed/elastic/agent/server/api.py ``_invoke_run``), and
    the store lives in one node's agent, so losing that node reads as RendezvousConnectionError
    on the others. :meth:`NodeWatch.settle` names the node then. ``last_step``: a step known
    from elsewhere (peers' heartbeats, other nodes' logs, this node's rank results).
    """
    m = _RDZV_FAIL.search(log_text)
    if not m or last_step is not None or last_step_seen(log_text) is not None:
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


def lost_node_message(node: int, silent_s: float, *, last_step: int | None, then: str) -> str:
    """One line naming a node whose agent stopped beating; ``then``: what this node did about it."""
    what = f"node rank {node} stopped" if last_step is None else f"node rank {node} was lost mid-training (last step seen: {last_step})"
    return (
        f"{what}: its agent's heartbeat (alive-node-{node}.json) has not changed for {silent_s:.0f} s "
        f"(agent killed or node lost); {then}"
    )


class ProgressTracker:
    """Passes each line of the job's output on to ``on_line`` and remembers the last optimizer
    step rank 0 reported in it (None until training starts)."""

    def __init__(self, on_line: Callable[[str], None] | None = None):
        self.on_line = on_line
        self.step: int | None = None

    def __call__(self, line: str) -> None:
        step = progress_step(line)
        if step is not None:
            self.step = step if self.step is None else max(self.step, step)
        if self.on_line is not None:
            try:
                self.on_line(line)
            except Exception:  # a broken display callback must not stop the tracking  # noqa: BLE001
                self.on_line = None


class NodeWatch:
    """Heartbeats between torchrun node agents through the shared probe folder.

    A node whose agent dies mid-probe (killed, or its machine lost) leaves the other nodes'
    ranks waiting in a collective or in gloo's connect loop until the probe timeout; torchrun's
    elastic agent does not notice a node leaving. Each agent rewrites ``alive-node-<K>.json``
    every :data:`HEARTBEAT_INTERVAL_S` with the last training step its log showed, and once more
    with ``ended`` when its job is over; a node whose file was seen changing and then stops
    changing for ``stale_s`` without ending (measured on this node's clock: no clock skew between
    nodes) ends the probe here with a reason naming it. Calling the object does one round when due.
    """

    def __init__(
        self,
        workdir: Path,
        launch: NodeLaunch,
        *,
        stale_s: float | None = None,
        interval_s: float = HEARTBEAT_INTERVAL_S,
        progress: ProgressTracker | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.workdir = workdir
        self.launch = launch
        self.interval_s = interval_s
        env_stale = os.environ.get("ZEROPLAN_NODE_STALE_S")
        self.stale_s = stale_s if stale_s is not None else float(env_stale) if env_stale else DEFAULT_NODE_STALE_S
        self.progress = progress
        self._clock, self._sleep = clock, sleep
        self._beats = 0
        self._next = 0.0
        self._seen: dict[int, tuple[str, float]] = {}  # node -> (last content, clock time it changed)
        self.heartbeats: dict[int, dict] = {}
        """Each peer's last heartbeat written during this probe (``step``, ``ended`` ...)."""

    @property
    def me(self) -> int:
        return self.launch.node_rank or 0

    @property
    def last_step(self) -> int | None:
        """The last training step this node's log or any peer's heartbeat showed."""
        own = {self.me: {"step": self.progress.step}} if self.progress is not None else {}
        return last_step_seen("", self.heartbeats | own)

    def beat(self, *, ended: bool = False) -> None:
        """Rewrite this node's heartbeat (``ended``: this node's job is over, it is not lost)."""
        self._beats += 1
        step = self.progress.step if self.progress is not None else None
        path = self.workdir / f"alive-node-{self.me}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        data = {"node_rank": self.me, "beat": self._beats, "pid": os.getpid(), "unix": time.time(), "step": step, "ended": ended}
        try:
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)
        except OSError:
            pass

    def _read_peers(self, now: float) -> None:
        for k in range(self.launch.nnodes):
            if k == self.me:
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
                try:
                    self.heartbeats[k] = json.loads(text)
                except ValueError:
                    pass

    def stopped(self, now: float) -> list[tuple[int, float]]:
        """(node, seconds silent) of peers that were beating and went silent for ``stale_s`` without ending."""
        return [
            (k, now - changed)
            for k, (_, changed) in sorted(self._seen.items())
            if changed >= 0 and not self.heartbeats.get(k, {}).get("ended") and now - changed > self.stale_s
        ]

    def __call__(self) -> str | None:
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.interval_s
        self.beat()
        self._read_peers(now)
        for k, silent_s in self.stopped(now):
            return lost_node_message(k, silent_s, last_step=self.last_step, then="this node's job was stopped")
        return None

    def settle(self, *, last_step: int | None = None) -> str | None:
        """After this node's job failed: mark it ended, then wait (at most ``stale_s`` and two
        beats) until every peer that was beating has ended or gone silent. One line naming a
        silent peer, else None (the peers ended too, or still beat). ``last_step``: the last
        training step known from evidence other than the heartbeats (the job logs, rank results)."""
        self.beat(ended=True)
        deadline = self._clock() + self.stale_s + 2 * self.interval_s
        while True:
            now = self._clock()
            self._read_peers(now)
            for k, silent_s in self.stopped(now):
                step = max((s for s in (last_step, self.last_step) if s is not None), default=None)
                return lost_node_message(k, silent_s, last_step=step, then="this node's job failed without it")
            beating = [k for k, (_, changed) in self._seen.items() if changed >= 0 and not self.heartbeats.get(k, {}).get("ended")]
            if not beating or now >= deadline:
                return None
            self._sleep(min(self.interval_s / 4, max(deadline - now, 0.0)))
