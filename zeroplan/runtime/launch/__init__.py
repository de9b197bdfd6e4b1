"""Launching a probe: the :class:`Launcher` protocol (start, wait, cancel, where its files go) and
its kinds, registered by name in :mod:`zeroplan.runtime.launch.registry`: ``warm`` (ranks forked
from a server that imported torch once), ``torchrun`` (one node, or one agent per node with a c10d
rendezvous) and ``slurm`` (one srun step per probe). No torch here."""

from zeroplan.runtime.launch.base import LaunchFiles, LaunchHandle, LaunchJob, Launcher, LauncherUnavailable
from zeroplan.runtime.launch.registry import (
    DEFAULT_NODES,
    DEFAULT_ONE_NODE,
    LAUNCHERS,
    launcher,
    launcher_for,
    local_launchers,
    node_launchers,
    one_node_launcher,
)

__all__ = [
    "DEFAULT_NODES",
    "DEFAULT_ONE_NODE",
    "LAUNCHERS",
    "LaunchFiles",
    "LaunchHandle",
    "LaunchJob",
    "Launcher",
    "LauncherUnavailable",
    "launcher",
    "launcher_for",
    "local_launchers",
    "node_launchers",
    "one_node_launcher",
]
