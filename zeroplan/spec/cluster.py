"""GpuSpec and ClusterSpec: the hardware a plan must fit on."""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroplan.spec.errors import SpecError, check_positive_float, check_positive_int

__all__ = ["GpuSpec", "ClusterSpec", "GiB", "GB"]

GiB = 1024**3
GB = 10**9

#: Upper bounds that catch typos (bytes, FLOP/s, bytes/s).
_MAX_MEMORY = 2**50  # 1 PiB
_MAX_FLOPS = 1e18
_MAX_BANDWIDTH = 1e15


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator model, from a datasheet (``profiles/gpus/*.toml``) or from ``zeroplan calibrate``."""

    name: str
    """Profile id, e.g. ``a100-80gb``."""
    memory_bytes: int
    """Device memory in bytes (as the driver reports it: 80 GiB parts show ~79.2 GiB usable)."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per precision: keys ``bf16``, ``fp16``, ``fp32`` (no sparsity)."""
    memory_bandwidth: float
    """HBM/GDDR bandwidth in bytes/s."""
    intra_node_bandwidth: float
    """Per-GPU unidirectional bandwidth to peers in the node (NVLink/xGMI, else PCIe), bytes/s."""
    host_bandwidth: float
    """Host↔device bandwidth (PCIe) per GPU, bytes/s, used for offload traffic."""
    inter_node_bandwidth: float
    """Per-GPU network bandwidth across nodes in a typical node of this GPU, bytes/s."""
    display_name: str = ""
    """Human name, e.g. ``NVIDIA A100 80GB SXM``."""
    source: str = ""
    """Datasheet or measurement this profile comes from."""
    efficiency: float = 0.45
    """Fraction of peak FLOP/s a large transformer step reaches (MFU); calibrate measures it."""
    cpu_adam_params_per_s: float = 1.0e9
    """Parameters per second a host CPU Adam step processes per GPU's share (offload timing)."""
    collective_latency_s: float = 2e-5
    """Per-collective latency α (s) for the α + S/B model."""
    step_overhead_s: float = 0.0
    """Fixed engine cost per optimizer step (s): Python, hooks, launches; 0 unless calibrated."""
    stage3_layer_overhead_s: float = 0.0
    """Extra ZeRO-3 cost per layer and micro-step (s): gather/release hooks; 0 unless calibrated."""
    hook_call_s: float = 0.0
    """Seconds one engine hook call costs (a Python call dispatched by autograd or a module); 0 unless measured."""
    comm_stream: bool = True
    """Collectives run on a stream of their own beside compute (CUDA/ROCm), so DeepSpeed's
    ``overlap_comm`` and ZeRO-3 prefetching can hide them; false for a CPU, which DeepSpeed's
    accelerator calls a synchronized device (no side stream: a collective blocks the code that issues it)."""

    def __post_init__(self) -> None:
        check_positive_int("gpu memory_bytes", self.memory_bytes, minimum=1, maximum=_MAX_MEMORY)
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise SpecError(f"gpu {self.name}: peak_flops must be a table of precision = FLOP/s")
        for prec in ("bf16", "fp16", "fp32"):
            if prec not in self.peak_flops:
                raise SpecError(f"gpu {self.name}: peak_flops lacks '{prec}'; give bf16, fp16 and fp32")
            check_positive_float(f"gpu {self.name} peak_flops.{prec}", self.peak_flops[prec], maximum=_MAX_FLOPS)
        for attr in ("memory_bandwidth", "intra_node_bandwidth", "host_bandwidth", "inter_node_bandwidth"):
            check_positive_float(f"gpu {self.name} {attr}", getattr(self, attr), maximum=_MAX_BANDWIDTH)
        check_positive_float(f"gpu {self.name} efficiency", self.efficiency, maximum=1.0)
        check_positive_float(f"gpu {self.name} cpu_adam_params_per_s", self.cpu_adam_params_per_s, maximum=1e13)
        check_positive_float(
            f"gpu {self.name} collective_latency_s", self.collective_latency_s, maximum=1.0, allow_zero=True
        )
        check_positive_float(
            f"gpu {self.name} step_overhead_s", self.step_overhead_s, maximum=3600.0, allow_zero=True
        )
        check_positive_float(
            f"gpu {self.name} stage3_layer_overhead_s", self.stage3_layer_overhead_s, maximum=60.0, allow_zero=True
        )
        check_positive_float(f"gpu {self.name} hook_call_s", self.hook_call_s, maximum=1.0, allow_zero=True)
        if not isinstance(self.comm_stream, bool):
            raise SpecError(f"gpu {self.name}: comm_stream = {self.comm_stream!r} is not valid; give true (a GPU) or false (a CPU)")

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "display_name": self.display_name,
            "memory_bytes": self.memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "intra_node_bandwidth": self.intra_node_bandwidth,
            "host_bandwidth": self.host_bandwidth,
            "inter_node_bandwidth": self.inter_node_bandwidth,
            "efficiency": self.efficiency,
            "cpu_adam_params_per_s": self.cpu_adam_params_per_s,
            "collective_latency_s": self.collective_latency_s,
            "step_overhead_s": self.step_overhead_s,
            "stage3_layer_overhead_s": self.stage3_layer_overhead_s,
            "hook_call_s": self.hook_call_s,
            "comm_stream": self.comm_stream,
            "source": self.source,
        }


@dataclass(frozen=True)
class ClusterSpec:
    """How many GPUs, how they are grouped into nodes, and the host resources per node."""

    gpus: int
    """Total GPUs (data-parallel world size N_d)."""
    gpus_per_node: int
    """GPUs per node (min(gpus, 8) by default)."""
    gpu: GpuSpec
    """The GPU model."""
    gpu_memory_bytes: int = 0
    """Usable memory per GPU in bytes (0: the profile's ``memory_bytes``)."""
    cpu_memory_per_node_bytes: int = 0
    """Host RAM per node available to training, bytes (0: detected with psutil by the caller)."""
    nvme_per_node_bytes: int = 0
    """NVMe capacity per node for ZeRO-Infinity offload, bytes (0: no NVMe)."""
    notes: tuple[str, ...] = field(default=())
    """How defaults were chosen (detected GPU, assumed RAM, ...)."""
    node: str = ""
    """Node profile the host figures come from (``profiles/nodes``), or empty."""
    cpu_memory_source: str = ""
    """Where ``cpu_memory_per_node_bytes`` comes from: ``--cpu-memory``, ``local`` (psutil on this
    machine), ``node:<profile>``, or ``unknown`` (0: host memory not checked)."""

    def __post_init__(self) -> None:
        check_positive_int("gpus", self.gpus, maximum=1_000_000)
        check_positive_int("gpus_per_node", self.gpus_per_node, maximum=1024)
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise SpecError(
                f"gpus={self.gpus} is not a multiple of gpus_per_node={self.gpus_per_node}; "
                f"with more than one node every node must be full (e.g. --gpus "
                f"{(self.gpus // self.gpus_per_node + 1) * self.gpus_per_node})"
            )
        if self.gpu_memory_bytes == 0:
            object.__setattr__(self, "gpu_memory_bytes", self.gpu.memory_bytes)
        check_positive_int("gpu_memory_bytes", self.gpu_memory_bytes, maximum=_MAX_MEMORY)
        check_positive_int("cpu_memory_per_node_bytes", self.cpu_memory_per_node_bytes, minimum=0, maximum=_MAX_MEMORY)
        check_positive_int("nvme_per_node_bytes", self.nvme_per_node_bytes, minimum=0, maximum=2**60)

    @property
    def nodes(self) -> int:
        """Number of nodes (ceil(gpus / gpus_per_node))."""
        return -(-self.gpus // self.gpus_per_node)

    @property
    def gpus_in_node(self) -> int:
        """GPUs actually present in one node (gpus itself when the job is smaller than a node)."""
        return min(self.gpus, self.gpus_per_node)

    def as_dict(self) -> dict:
        return {
            "gpus": self.gpus,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "gpu": self.gpu.name,
            "gpu_memory": self.gpu_memory_bytes,
            "cpu_memory_per_node": self.cpu_memory_per_node_bytes,
            "nvme_per_node": self.nvme_per_node_bytes,
            "node": self.node,
            "cpu_memory_source": self.cpu_memory_source,
            "notes": list(self.notes),
        }
