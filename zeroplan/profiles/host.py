"""Whose RAM: the host memory and NVMe per node a plan is checked against, and where they come from.

The planner plans for the cluster the user names, not for the machine it runs on: a laptop or
a login node with 24 GiB says nothing about a DGX's 2 TB. Order of precedence:

1. ``--cpu-memory N`` (GiB per node), or ``--cpu-memory local`` (this machine, psutil);
2. ``--node NAME``: that node profile;
3. this machine, when NVML finds the target GPU here (or the jobs run here: ``tune``/``probe``);
4. the node profile that stands for the target GPU (``default_for_gpu``);
5. unknown: host memory is not checked, and the output says so.

NVMe follows the same source unless ``--nvme`` is given (0 for this machine: not detected).
Standard library only (psutil is imported only for ``local``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from zeroplan.spec import GiB, GpuSpec, SpecError

if TYPE_CHECKING:
    from zeroplan.spec import NodeSpec

__all__ = ["HostResources", "local_cpu_memory", "parse_cpu_memory", "resolve_host"]


@dataclass(frozen=True)
class HostResources:
    """Host RAM and NVMe per node for planning, with their origin."""

    cpu_memory_bytes: int
    """Host RAM per node in bytes; 0 when unknown (then not checked)."""
    nvme_bytes: Optional[int]
    """NVMe per node from the same source, or None when the source says nothing (no profile)."""
    source: str
    """``--cpu-memory``, ``local``, ``node:<name>`` or ``unknown``."""
    note: str
    """One sentence for the output: the figure and where it came from."""
    node: Optional[NodeSpec] = None
    """The node profile used, if any."""


def local_cpu_memory(option: str = "--cpu-memory local") -> int:
    """Total RAM of this machine (psutil), or SpecError naming ``option`` when psutil cannot tell."""
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except Exception as exc:  # noqa: BLE001 - ImportError, psutil.Error, OSError: all mean "cannot read"
        raise SpecError(
            f"{option}: cannot read this machine's RAM ({type(exc).__name__}: {exc}); give --cpu-memory N in GiB per node"
        ) from None
    if total <= 0:
        raise SpecError(f"{option}: psutil reports {total} bytes of RAM; give --cpu-memory N in GiB per node")
    return total


def parse_cpu_memory(value: str) -> Optional[int]:
    """``--cpu-memory``: a positive number of GiB per node → bytes, or None for ``local``."""
    text = str(value).strip()
    if text.lower() == "local":
        return None
    try:
        gib = float(text)
    except ValueError:
        raise SpecError(f"--cpu-memory {value!r} is not valid; give GiB per node (e.g. 2048) or 'local'") from None
    if not math.isfinite(gib) or gib <= 0:
        raise SpecError(f"--cpu-memory {value} is not valid; give a positive number of GiB per node or 'local'")
    from zeroplan.spec.node import MAX_NODE_MEMORY_BYTES

    if gib * GiB > MAX_NODE_MEMORY_BYTES:
        raise SpecError(
            f"--cpu-memory {value} GiB is more than any node holds (at most {MAX_NODE_MEMORY_BYTES // GiB} GiB); "
            f"give host RAM per node in GiB, not per cluster or in MiB"
        )
    return int(gib * GiB)


def _node_note(node: NodeSpec, why: str) -> str:
    return (
        f"CPU memory per node: {node.cpu_memory_bytes / GiB:,.0f} GiB, NVMe {node.nvme_bytes / 1e12:.1f} TB from node "
        f"profile {node.name} ({node.display_name or node.name}, {node.source}); {why}"
    )


def resolve_host(
    gpu: GpuSpec,
    *,
    gpu_here: bool,
    cpu_memory: Optional[str] = None,
    node: Optional[NodeSpec] = None,
    runs_here: bool = False,
) -> HostResources:
    """Host RAM and NVMe per node for planning on ``gpu`` (precedence in the module docstring).

    ``gpu_here``: NVML found ``gpu`` on this machine. ``runs_here``: the jobs run on this
    machine whatever the GPU (``zeroplan tune`` / ``probe``), so its RAM is the limit.
    """
    if cpu_memory is not None:
        given = parse_cpu_memory(cpu_memory)
        if given is None:
            total = local_cpu_memory()
            return HostResources(total, None, "local", f"CPU memory per node: {total / GiB:.0f} GiB (this machine, psutil; --cpu-memory local)", node)
        return HostResources(given, node.nvme_bytes if node else None, "--cpu-memory", f"CPU memory per node: {given / GiB:,.0f} GiB (--cpu-memory)", node)
    if node is not None:
        return HostResources(node.cpu_memory_bytes, node.nvme_bytes, f"node:{node.name}", _node_note(node, "chosen with --node"), node)
    if gpu_here or runs_here:
        total = local_cpu_memory("this machine's RAM")
        why = "the jobs run here" if runs_here and not gpu_here else f"NVML finds the {gpu.name} here"
        return HostResources(total, None, "local", f"CPU memory per node: {total / GiB:.0f} GiB (this machine, psutil: {why}; set --cpu-memory or --node)")
    from zeroplan.profiles import default_node

    stand_in = default_node(gpu.name)
    if stand_in is not None:
        why = f"the {gpu.name} is not on this machine, so not this machine's RAM; set --node, --cpu-memory N or --cpu-memory local"
        return HostResources(stand_in.cpu_memory_bytes, stand_in.nvme_bytes, f"node:{stand_in.name}", _node_note(stand_in, why), stand_in)
    return HostResources(
        0,
        None,
        "unknown",
        f"CPU memory per node: unknown (no node profile for {gpu.name}, and it is not on this machine): host memory "
        f"is not checked; set --node NAME or --cpu-memory N",
    )
