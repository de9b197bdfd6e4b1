"""The launcher protocol: how a probe's ranks start, how the probe waits for them, how it stops
them, and where their files go.

A launcher kind is one class deriving from :class:`Launcher`, registered by name in
:mod:`zeroplan.runtime.launch.registry`. Callers ask the launcher (``launcher.agent_per_node``,
``launcher.files(...)``, ``launcher.preflight(...)``) instead of comparing its name, so a new kind
(Kubernetes, ``accelerate launch``) is one module and one registry entry. The shape follows
Optuna's ``BaseStorage``: the base class states the contract, each kind keeps it.

Contract:

* :meth:`Launcher.start` starts the job and returns a :class:`LaunchHandle` whose ``process``
  streams the job's output into ``files(...).log`` and can kill every process it started; it
  writes ``files(...).command``. It raises :class:`LauncherUnavailable` (and has started nothing)
  when this kind cannot run here; the caller then uses :attr:`Launcher.fallback`.
* :meth:`Launcher.wait` returns (exit code, timed out) and never kills; :meth:`Launcher.cancel`
  stops the job everywhere it runs (a scheduler's remote tasks included).
* No torch here: launchers run in the process that drives the probes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Mapping, Optional

if TYPE_CHECKING:  # annotations only: the node layout validates itself through this module's registry
    from zeroplan.runtime.launch.job import Job
    from zeroplan.runtime.launch.multinode import NodeLaunch, NodeWatch

__all__ = ["LaunchFiles", "LaunchHandle", "LaunchJob", "Launcher", "LauncherUnavailable"]


class LauncherUnavailable(RuntimeError):
    """This launcher cannot start a job here (the reason is the message); nothing was started."""


@dataclass(frozen=True)
class LaunchFiles:
    """Where one launcher's files go in the probe folder (one set per node agent in a shared folder)."""

    log: Path
    """The job's combined output, line by line (``tail -f`` follows the probe)."""
    command: Path
    """What was started, one line (a torchrun command, or what the warm server forked)."""
    result: Path
    """The probe's record (``ProbeResult`` with the wall time, the plan and the nodes)."""


@dataclass(frozen=True)
class LaunchJob:
    """What to start: one probe's ranks on this node (or, for a scheduler, on every node)."""

    spec_path: Path
    """The worker's instructions (``probe.json``; ``python -m zeroplan.runtime.rank.worker SPEC``)."""
    nproc: int
    """Ranks per node."""
    env: Mapping[str, str]
    """The ranks' environment (:func:`zeroplan.runtime.probe.probe_environment`)."""
    workdir: Path
    """The probe folder (shared by every node of a multi-node probe)."""
    on_line: Optional[Callable[[str], None]] = None
    """Called with each line of the job's output."""
    nodes: Optional["NodeLaunch"] = None
    """The node layout of a probe across nodes (``NodeLaunch.multinode``); None: one node."""
    torchrun_args: tuple[str, ...] = ()
    """Extra torchrun arguments the user gave (one-node torchrun only)."""
    ready_timeout_s: float = 300.0
    """Seconds a launcher may wait for something of its own to be ready (the warm server)."""
    cwd: Path = field(default_factory=Path.cwd)
    """The ranks' working directory: the user's, as under a plain torchrun."""

    @property
    def node_rank(self) -> Optional[int]:
        """This agent's node rank across nodes; None on one node or where the scheduler picks it."""
        return self.nodes.node_rank if self.nodes is not None else None


@dataclass
class LaunchHandle:
    """A started job, as its launcher returned it."""

    launcher: "Launcher"
    """The launcher that started it (a fallback's, when the one asked for was unavailable)."""
    job: LaunchJob
    """What was started."""
    process: "Job"
    """The running process tree: streams the output, remembers every descendant, kills them all."""
    started_at: float
    """``time.monotonic()`` when the plan's ranks began to start: the plan's clock and timeout
    run from here; waiting on the launcher's own readiness (a warm server's imports) is before it."""
    info: dict = field(default_factory=dict)
    """Facts of a job across nodes: ``endpoint``, ``rdzv_id``, and for a scheduler ``step_name``,
    ``job_id``, ``hosts``."""
    watch: Optional["NodeWatch"] = None
    """Heartbeats with the other nodes' agents, where each node runs its own agent; else None."""


class Launcher(ABC):
    """One way to start a probe's ranks. Class attributes are the facts callers ask for."""

    name: ClassVar[str]
    """The ``--launcher`` value (the registry's key)."""
    help: ClassVar[str]
    """One phrase for ``--launcher``'s help."""
    one_node: ClassVar[bool] = True
    """It starts the ranks of a one-node probe (a ``ProbeRequest.launcher`` value)."""
    spans_nodes: ClassVar[bool] = False
    """It runs a probe across nodes (a ``NodeLaunch.launcher`` value)."""
    scheduled: ClassVar[bool] = False
    """It runs every probe as a scheduler's job step, so a probe is a node job even on one node."""
    agent_per_node: ClassVar[bool] = False
    """Every node runs its own zeroplan agent: node 0's announces each probe (``launch.json``) and
    the tuner's end, the others follow it, and the agents exchange heartbeats."""
    warm: ClassVar[bool] = False
    """Its ranks are forked from a process that imported torch and DeepSpeed once."""
    fallback: ClassVar[Optional[type["Launcher"]]] = None
    """The launcher used when this one raises :class:`LauncherUnavailable`."""
    one_node_launcher: ClassVar[Optional[type["Launcher"]]] = None
    """What starts a one-node request that asked for this kind (None: this kind itself)."""

    # --- what callers ask ----------------------------------------------------------------

    def accepts(self, torchrun_args: tuple[str, ...]) -> bool:
        """It runs a one-node request with these extra torchrun arguments as asked (else its fallback does)."""
        return True

    def check_nodes(self, nodes: "NodeLaunch") -> None:
        """Raise SpecError (one line, the flag and the fix) for a node layout this kind cannot run."""

    def preflight(self, nodes: "NodeLaunch") -> None:
        """Raise SpecError when the job cannot start here (outside an allocation ...), before anything is written."""

    def peer_start_skew_s(self, nodes: "NodeLaunch") -> float:
        """How long before this agent another node's agent may have started (markers older than that are stale)."""
        return 0.0

    def files(self, workdir: Path, node_rank: Optional[int] = None) -> LaunchFiles:
        """Where this launcher's files go in ``workdir`` (``node_rank``: this agent's node)."""
        return LaunchFiles(log=workdir / "probe.log", command=workdir / "command.txt", result=workdir / "result.json")

    # --- running -------------------------------------------------------------------------

    @abstractmethod
    def start(self, job: LaunchJob) -> LaunchHandle:
        """Start ``job``; :class:`LauncherUnavailable` when this kind cannot run here."""

    def wait(self, handle: LaunchHandle, timeout_s: float, *, not_charged: Optional[Callable[[], bool]] = None) -> tuple[Optional[int], bool]:
        """(exit code, timed out) once the job ended or ``timeout_s`` passed (plus the time
        ``not_charged`` reports: a DeepSpeed op being built); a lost peer node stops the wait
        early (``handle.process.aborted``)."""
        result = handle.process.wait(timeout_s, handle.watch, not_charged=not_charged)
        if handle.watch is not None:
            # This node's job is over: its peers must not read it as lost. Said before the clean-up,
            # which beats no heartbeat while it runs (Job.kill_all up to 9 s, Job.close 5 s).
            handle.watch.beat(ended=True)
        return result

    def cancel(self, handle: LaunchHandle) -> None:
        """Stop the job: SIGTERM, then SIGKILL, to every process group it started."""
        handle.process.kill_all()
