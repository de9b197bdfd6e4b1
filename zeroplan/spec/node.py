"""NodeSpec: one node type (a DGX, a cloud instance) — the host RAM, NVMe and NICs around its GPUs."""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.spec.errors import SpecError, check_positive_float, check_positive_int

__all__ = ["NodeSpec", "MAX_NODE_MEMORY_BYTES"]

#: Host RAM no single node holds (64 TiB; the largest single-system-image servers ship with
#: 24–48 TB). A figure above it is a typo (TB for GB, bytes for GiB), not a node.
MAX_NODE_MEMORY_BYTES = 64 * 1024**4


@dataclass(frozen=True)
class NodeSpec:
    """A node type from its datasheet or instance page (``profiles/nodes/*.toml``)."""

    name: str
    """Profile id, e.g. ``dgx-a100-640gb`` or ``aws-p4d.24xlarge``."""
    gpu: str
    """GPU profile name of the node's accelerators (``profiles/gpus``)."""
    gpus_per_node: int
    """Accelerators in one node."""
    cpu_memory_bytes: int
    """Host RAM of one node in bytes, as the vendor states it (GiB or TB converted exactly)."""
    nvme_bytes: int
    """Local NVMe (instance store, data drives) of one node in bytes; 0 when none is bundled."""
    nics: str
    """The node's network adapters, as the vendor lists them."""
    network_gbps: float
    """Inter-node bandwidth of one node, Gb/s, all compute NICs together."""
    source: str
    """Datasheet or instance page (URL) the figures come from."""
    display_name: str = ""
    """Human name, e.g. ``NVIDIA DGX A100 640GB``."""
    default_for_gpu: bool = False
    """This node stands for its GPU when the GPU is not on this machine and no node is named."""

    def __post_init__(self) -> None:
        for key in ("name", "gpu", "nics", "source"):
            value = getattr(self, key)
            if not isinstance(value, str) or not value.strip():
                raise SpecError(f"node {self.name!r}: {key} = {value!r} must be a non-empty string")
        check_positive_int(f"node {self.name} gpus_per_node", self.gpus_per_node, maximum=1024)
        check_positive_int(
            f"node {self.name} cpu_memory_bytes", self.cpu_memory_bytes, minimum=1, maximum=MAX_NODE_MEMORY_BYTES
        )
        check_positive_int(f"node {self.name} nvme_bytes", self.nvme_bytes, minimum=0, maximum=2**60)
        check_positive_float(f"node {self.name} network_gbps", self.network_gbps, maximum=1e6)
        if not isinstance(self.default_for_gpu, bool):
            raise SpecError(f"node {self.name}: default_for_gpu = {self.default_for_gpu!r} must be true or false")

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "display_name": self.display_name,
            "gpu": self.gpu,
            "gpus_per_node": self.gpus_per_node,
            "cpu_memory_bytes": self.cpu_memory_bytes,
            "nvme_bytes": self.nvme_bytes,
            "nics": self.nics,
            "network_gbps": self.network_gbps,
            "default_for_gpu": self.default_for_gpu,
            "source": self.source,
        }
