"""Options shared by ``probe`` and ``tune`` for jobs across nodes (zeroplan.runtime.multinode)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from zeroplan.spec import SpecError

__all__ = [
    "NnodesOpt",
    "NodeRankOpt",
    "RdzvEndpointOpt",
    "RdzvTimeoutOpt",
    "LauncherOpt",
    "resolve_nodes",
]

_NODES = "Nodes"

NnodesOpt = Annotated[int, typer.Option("--nnodes", help="Nodes in each probe (--gpus = nodes × --gpus-per-node).", rich_help_panel=_NODES)]
LauncherOpt = Annotated[
    str,
    typer.Option("--launcher", help="torchrun (one zeroplan agent per node, c10d rendezvous) | slurm (one srun step per probe, inside salloc/sbatch).", rich_help_panel=_NODES),
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
    launcher: str,
    node_rank: Optional[int],
    rdzv_endpoint: Optional[str],
    rdzv_timeout: float,
    legacy_torchrun_args: tuple[str, ...] = (),
):
    """(processes per node, NodeLaunch or None for a plain one-node job); SpecError on bad input."""
    from zeroplan.runtime.multinode import NodeLaunch, check_node_layout

    if nnodes == 1 and gpus_per_node is not None and gpus > gpus_per_node >= 1 and not any(a.startswith("--nnodes") for a in legacy_torchrun_args):
        raise SpecError(
            f"--gpus {gpus} with --gpus-per-node {gpus_per_node} spans nodes: give --nnodes {-(-gpus // gpus_per_node)} "
            "and either --launcher slurm (inside an allocation) or one agent per node with --node-rank K --rdzv-endpoint HOST:PORT"
        )
    nproc = check_node_layout(gpus=gpus, nnodes=nnodes, gpus_per_node=gpus_per_node)
    launch = NodeLaunch(nnodes=nnodes, launcher=launcher, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_timeout_s=rdzv_timeout)
    return nproc, (launch if launch.multinode else None)
