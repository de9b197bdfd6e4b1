"""Every launcher kind by its ``--launcher`` name: the one place a kind's name becomes its class.

A new kind (Kubernetes, ``accelerate launch``) is a module with a :class:`~zeroplan.runtime.launch.base.Launcher`
subclass and one entry in :data:`LAUNCHERS`; ``--launcher``'s choices, help and checks follow.
"""

from __future__ import annotations

from typing import Optional

from zeroplan.runtime.launch.base import Launcher
from zeroplan.runtime.launch.slurm_step import SlurmLauncher
from zeroplan.runtime.launch.torchrun import TorchrunLauncher
from zeroplan.runtime.launch.warm_fork import WarmLauncher

__all__ = [
    "DEFAULT_NODES",
    "DEFAULT_ONE_NODE",
    "LAUNCHERS",
    "launcher",
    "launcher_for",
    "local_launchers",
    "node_launchers",
    "one_node_launcher",
]

#: Launcher classes by name, in the order ``--launcher``'s help and messages list them.
LAUNCHERS: dict[str, type[Launcher]] = {cls.name: cls for cls in (WarmLauncher, TorchrunLauncher, SlurmLauncher)}
#: What starts a one-node probe when ``--launcher`` is not given.
DEFAULT_ONE_NODE = WarmLauncher.name
#: What runs a probe across nodes when ``--launcher`` is not given.
DEFAULT_NODES = TorchrunLauncher.name


def local_launchers() -> tuple[str, ...]:
    """Values of ``ProbeRequest.launcher``: the kinds that start one node's ranks."""
    return tuple(name for name, cls in LAUNCHERS.items() if cls.one_node)


def node_launchers() -> tuple[str, ...]:
    """Values of ``NodeLaunch.launcher``: the kinds that run a probe across nodes."""
    return tuple(name for name, cls in LAUNCHERS.items() if cls.spans_nodes)


def launcher(name: str) -> Launcher:
    """The launcher called ``name`` (callers check the name against the tuple their flag allows)."""
    return LAUNCHERS[name]()


def one_node_launcher(name: Optional[str]) -> str:
    """The ``ProbeRequest.launcher`` for ``--launcher name`` (None or unknown: the default)."""
    cls = LAUNCHERS.get(name) if name is not None else None
    if cls is None:
        return DEFAULT_ONE_NODE
    return (cls.one_node_launcher or cls).name


def launcher_for(request) -> Launcher:
    """The launcher that runs a ``ProbeRequest``: the node layout's kind across nodes, else the
    one asked for where it accepts the request (the warm launcher takes no torchrun arguments),
    else its fallback."""
    nodes = request.nodes
    if nodes is not None and nodes.multinode:
        return launcher(nodes.launcher)
    chosen = launcher(request.launcher)
    if chosen.accepts(request.torchrun_args) or chosen.fallback is None:
        return chosen
    return chosen.fallback()
