"""Options shared by ``probe`` and ``tune`` for jobs across nodes (zeroplan.runtime.launch.multinode), and
``tune``'s multi-node steps: a follower node's agent and the ``--emit-sbatch`` batch script."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from zeroplan.runtime.launch.registry import DEFAULT_NODES, DEFAULT_ONE_NODE, LAUNCHERS, node_launchers, one_node_launcher
from zeroplan.spec import SpecError

__all__ = [
    "NnodesOpt",
    "NodeRankOpt",
    "RdzvEndpointOpt",
    "RdzvTimeoutOpt",
    "LauncherOpt",
    "local_launcher",
    "resolve_nodes",
    "follow_node0",
    "write_sbatch",
]

_NODES = "Nodes"

NnodesOpt = Annotated[int, typer.Option("--nnodes", help="Nodes in each probe (--gpus = nodes × --gpus-per-node).", rich_help_panel=_NODES)]
LauncherOpt = Annotated[
    Optional[str],
    typer.Option(
        "--launcher",
        help=" | ".join(f"{name} ({kind.help})" for name, kind in LAUNCHERS.items())
        + f" [default: {DEFAULT_ONE_NODE} on one node, {DEFAULT_NODES} on several].",
        rich_help_panel=_NODES,
    ),
]
NodeRankOpt = Annotated[
    Optional[int], typer.Option("--node-rank", help="torchrun launcher, --nnodes > 1: this node's rank, 0..nnodes-1.", rich_help_panel=_NODES)
]
RdzvEndpointOpt = Annotated[
    Optional[str], typer.Option("--rdzv-endpoint", help="torchrun launcher, --nnodes > 1: HOST:PORT of the c10d rendezvous (node 0).", rich_help_panel=_NODES)
]
RdzvTimeoutOpt = Annotated[
    float, typer.Option("--rdzv-timeout", help="Seconds to wait for every node at the rendezvous.", rich_help_panel=_NODES)
]


def resolve_nodes(
    *,
    gpus: int,
    gpus_per_node: Optional[int],
    nnodes: int,
    launcher: Optional[str],
    node_rank: Optional[int],
    rdzv_endpoint: Optional[str],
    rdzv_timeout: float,
    legacy_torchrun_args: tuple[str, ...] = (),
):
    """(processes per node, NodeLaunch or None for a plain one-node job); SpecError on bad input.

    ``launcher`` None or a one-node kind (``warm``) on one node is a one-node job (:func:`local_launcher`
    says which launcher starts it); a one-node kind across nodes is refused.
    """
    from zeroplan.runtime.launch.multinode import NodeLaunch, check_node_layout

    if launcher is not None and launcher not in LAUNCHERS:
        raise SpecError(f"--launcher {launcher} is not valid; choose one of {', '.join(LAUNCHERS)}")
    if launcher is not None and not LAUNCHERS[launcher].spans_nodes and nnodes > 1:
        use = " or ".join(f"--launcher {name}" for name in node_launchers())
        raise SpecError(f"--launcher {launcher} starts the ranks of one node; with --nnodes {nnodes} use {use}")
    if launcher is None or not LAUNCHERS[launcher].spans_nodes:
        launcher = DEFAULT_NODES

    if nnodes == 1 and gpus_per_node is not None and gpus > gpus_per_node >= 1 and not any(a.startswith("--nnodes") for a in legacy_torchrun_args):
        raise SpecError(
            f"--gpus {gpus} with --gpus-per-node {gpus_per_node} spans nodes: give --nnodes {-(-gpus // gpus_per_node)} "
            "and either --launcher slurm (inside an allocation) or one agent per node with --node-rank K --rdzv-endpoint HOST:PORT"
        )
    nproc = check_node_layout(gpus=gpus, nnodes=nnodes, gpus_per_node=gpus_per_node)
    launch = NodeLaunch(nnodes=nnodes, launcher=launcher, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_timeout_s=rdzv_timeout)
    return nproc, (launch if launch.multinode else None)


def local_launcher(launcher: Optional[str]) -> str:
    """How a one-node probe starts its ranks (``ProbeRequest.launcher``): the kind asked for where it
    starts one node's ranks (``torchrun`` for ``slurm``), else the default, ``warm`` (a multi-node
    probe ignores it)."""
    return one_node_launcher(launcher)


def follow_node0(probes: Path, nodes: Any) -> None:
    """Run node ``nodes.node_rank``'s agent for every probe of node 0's tuner (see docs/multinode.md)."""
    from zeroplan.runtime import FOLLOW_DONE, follow_probes

    probes.mkdir(parents=True, exist_ok=True)
    stale = probes / FOLLOW_DONE
    if stale.exists() and time.time() - stale.stat().st_mtime > nodes.rdzv_timeout_s:
        stale.unlink()  # from an earlier run in the same folder

    def show(kind: str, **data: Any) -> None:
        if kind == "join":
            print(f"node {nodes.node_rank}: joining {data['trial']}", flush=True)
        elif kind == "joined":
            print(f"node {nodes.node_rank}: {data['trial']} ended (torchrun exit {data['returncode']})", flush=True)

    n = follow_probes(probes, node_rank=nodes.node_rank, rdzv_timeout_s=nodes.rdzv_timeout_s, on_event=show)
    print(f"node {nodes.node_rank}: node 0's tuner is done; joined {n} probes")


def write_sbatch(path: Path, *, nnodes: int, gpus_per_node: int, output: Path, time_budget: Optional[float]) -> None:
    """Write the batch script (zeroplan.runtime.launch.multinode.sbatch_script) for this command line."""
    from zeroplan.runtime.launch.multinode import sbatch_script, tune_command_for_sbatch

    argv = sys.argv[sys.argv.index("tune") + 1 :] if "tune" in sys.argv else []
    out_dir = output.resolve()
    text = sbatch_script(
        tune_args=tune_command_for_sbatch(argv, storage_default=str(out_dir / "study.journal")),
        nnodes=nnodes,
        gpus_per_node=gpus_per_node,
        python=sys.executable,
        cwd=os.getcwd(),
        output_dir=str(out_dir),
        time_limit_s=time_budget,
    )
    if path.is_dir():
        raise SpecError(f"--emit-sbatch {path} is a folder; give a file name such as job.sh")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)  # sbatch opens --output there before the script runs
        path.write_text(text)
    except OSError as exc:
        raise SpecError(f"--emit-sbatch {path}: cannot write ({exc.strerror})") from None
    path.chmod(0o755)
    print(f"wrote {path}: submit with sbatch {path} (several times for several workers on one study)")
