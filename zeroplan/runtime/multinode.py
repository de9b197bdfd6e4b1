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
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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


# --- Slurm ------------------------------------------------------------------------------------


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list (``SLURM_JOB_NODELIST``) as host names, in order.

    ``gpu[01-03,07],login1`` → gpu01 gpu02 gpu03 gpu07 login1; several bracket groups in one name
    expand as their product (``rack[1-2]-n[1-2]``); zero padding is kept (Slurm's hostlist.c).
    Used when ``scontrol show hostnames`` is not available.
    """
    names: list[str] = []
    for item in _split_top(text.strip()):
        if not item:
            continue
        names.extend(_expand_one(item))
    return names


def _split_top(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise SpecError(f"host list {text!r} has an unmatched ']'")
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    if depth:
        raise SpecError(f"host list {text!r} has an unmatched '['")
    parts.append(current)
    return parts


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, body, rest = m.groups()
    out = []
    for piece in body.split(","):
        if "-" in piece:
            lo, hi = piece.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise SpecError(f"host list range {piece!r} in {item!r} is not valid")
            width = len(lo)
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        else:
            if not piece.isdigit():
                raise SpecError(f"host list entry {piece!r} in {item!r} is not valid")
            values = [piece]
        for v in values:
            out.extend(prefix + v + tail for tail in _expand_one(rest))
    return out


@dataclass(frozen=True)
class SlurmAllocation:
    """The Slurm job this process runs in."""

    job_id: str
    """``SLURM_JOB_ID``."""
    hosts: tuple[str, ...]
    """Host names of the allocation's nodes, in Slurm's order (the first hosts the rendezvous)."""


def slurm_allocation(nnodes: int, env: dict[str, str] | None = None) -> SlurmAllocation:
    """The current allocation, checked to have ``nnodes`` nodes; SpecError (one line) otherwise."""
    env = dict(os.environ if env is None else env)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        raise SpecError(
            "--launcher slurm runs inside a Slurm allocation, and SLURM_JOB_ID is not set: "
            "start zeroplan under salloc or sbatch (tune --emit-sbatch writes a batch script), or use --launcher torchrun"
        )
    if shutil.which("srun", path=env.get("PATH")) is None:
        raise SpecError("--launcher slurm needs srun on PATH, and there is none")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    hosts = _scontrol_hostnames(nodelist, env) if nodelist else []
    if not hosts:
        raise SpecError(f"Slurm job {job_id} has no SLURM_JOB_NODELIST; cannot place the rendezvous")
    if len(hosts) < nnodes:
        raise SpecError(
            f"--nnodes {nnodes} but Slurm job {job_id} has {len(hosts)} node{'s' * (len(hosts) != 1)} ({nodelist}); "
            f"allocate at least {nnodes} (salloc --nodes {nnodes}) or lower --nnodes"
        )
    return SlurmAllocation(job_id=str(job_id), hosts=tuple(hosts))


def _scontrol_hostnames(nodelist: str, env: dict[str, str]) -> list[str]:
    """``scontrol show hostnames`` when Slurm's tools are here, else :func:`expand_hostlist`."""
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, env=env)
            hosts = out.stdout.split()
            if out.returncode == 0 and hosts:
                return hosts
        except (OSError, subprocess.TimeoutExpired):
            pass
    return expand_hostlist(nodelist)


def cancel_slurm_step(step_name: str, env: dict[str, str] | None = None) -> list[str]:
    """``scancel`` every step of this job named ``step_name`` (found with ``squeue --steps``).

    Slurm then kills every process of the step on every node (its cgroup), whatever srun did.
    Returns the step ids cancelled (empty when Slurm's tools are missing or the step is gone).
    """
    env = dict(os.environ if env is None else env)
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    squeue, scancel = shutil.which("squeue", path=env.get("PATH")), shutil.which("scancel", path=env.get("PATH"))
    if not (job_id and squeue and scancel):
        return []
    try:
        out = subprocess.run(
            [squeue, "--steps", "--jobs", str(job_id), "--noheader", "--format=%i %j"], capture_output=True, text=True, timeout=30, env=env
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    steps = [line.split()[0] for line in out.stdout.splitlines() if len(line.split()) >= 2 and line.split()[1] == step_name]
    for step in steps:
        try:
            subprocess.run([scancel, "--signal=KILL", step], capture_output=True, timeout=30, env=env)
            subprocess.run([scancel, step], capture_output=True, timeout=30, env=env)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return steps


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


# --- batch script -----------------------------------------------------------------------------


def tune_command_for_sbatch(argv: list[str], *, storage_default: str) -> list[str]:
    """The ``zeroplan tune`` arguments a batch job runs: ``argv`` (after ``tune``) without
    ``--emit-sbatch``, with ``--launcher slurm``, ``--resume`` (several jobs join one study) and,
    when no ``--storage`` was given, a journal file beside the output (safe on NFS)."""
    out: list[str] = []
    skip = False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in ("--emit-sbatch", "--launcher"):
            skip = True
            continue
        if arg.startswith(("--emit-sbatch=", "--launcher=")):
            continue
        out.append(arg)
    if "--" in out:
        cut = out.index("--")
        head, tail = out[:cut], out[cut:]
    else:
        head, tail = out, []
    head += ["--launcher", "slurm"]
    if "--resume" not in head:
        head.append("--resume")
    if not any(a == "--storage" or a.startswith("--storage=") for a in head):
        head += ["--storage", storage_default]
    return head + tail


def sbatch_script(
    *,
    tune_args: list[str],
    nnodes: int,
    gpus_per_node: int,
    python: str,
    cwd: str,
    output_dir: str,
    time_limit_s: float | None = None,
    job_name: str = "zeroplan-tune",
) -> str:
    """A ready ``sbatch`` script: one node set, one ``zeroplan tune`` worker that runs every probe
    as an ``srun`` step inside the allocation (submit it several times for several workers on
    one study)."""
    import shlex

    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nnodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        "#SBATCH --exclusive",
        f"#SBATCH --output={output_dir}/slurm-%j.out",
    ]
    if time_limit_s:
        # The tuner starts no probe after its budget; leave room for the last one and the report.
        minutes = int(time_limit_s // 60) + 30
        lines.append(f"#SBATCH --time={minutes // 60:02d}:{minutes % 60:02d}:00")
    lines += [
        "# Written by zeroplan tune --emit-sbatch. The output folder must be on a file system all",
        "# nodes share (probe results are written there); the study is shared through --storage.",
        "set -euo pipefail",
        f"cd {shlex.quote(cwd)}",
        f"mkdir -p {shlex.quote(output_dir)}",
        "export PYTHONUNBUFFERED=1",
        shlex.join([python, "-m", "zeroplan", "tune", *tune_args]),
        "",
    ]
    return "\n".join(lines)
