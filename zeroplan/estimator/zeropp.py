"""ZeRO++ (Wang et al. 2023, arXiv 2306.10209): quantized weights (qwZ), hierarchical partitioning
(hpZ) and quantized gradients (qgZ), as memory and traffic terms of a ZeRO-3 plan.

Paper, §3 ("Design"), with M the model size in bytes (16-bit weights):

* ZeRO-3 moves 3M per GPU per step across the data-parallel group: an all-gather of the weights
  in forward (M), another in backward (M) and a reduce-scatter of the gradients (M).
* qwZ (§3.1): the forward all-gather sends INT8 weights with block-based scales: 0.5M.
* hpZ (§3.2): a secondary copy of the weights, partitioned only within the node (the
  ``zero_hpz_partition_size`` ranks), is kept after forward; the backward all-gather reads it
  over NVLink/PCIe: no cross-node traffic. The cost is memory: the secondary partition,
  M / hpz bytes per GPU (16-bit weights split over the hpz ranks of the node).
* qgZ (§3.3): gradients are reduced by a hierarchical all-to-all in INT4 (first within the node,
  then across nodes): 0.25M across nodes.
* Together (§3, the abstract and Table 1): 3M → 0.5M + 0 + 0.25M = 0.75M, the "4× less
  communication".

DeepSpeed 0.19 (deepspeed/runtime/zero/stage3.py, partition_parameters.py): the quantized
all-to-all of qgZ runs only when ``world_size // device_count > 1`` (more than one node), and
the hpZ group is ``zero_hpz_partition_size`` consecutive ranks (utils/groups.py
``_create_zero_param_parallel_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ZeroPPTraffic", "zeropp_cross_node_traffic", "hpz_secondary_bytes", "QWZ_FACTOR", "QGZ_FACTOR"]

#: qwZ: INT8 instead of 16-bit weights in the forward all-gather (§3.1): half the bytes.
QWZ_FACTOR = 0.5
#: qgZ: INT4 instead of 16-bit gradients in the reduce (§3.3): a quarter of the bytes.
QGZ_FACTOR = 0.25


@dataclass(frozen=True)
class ZeroPPTraffic:
    """Cross-node bytes per GPU per step of ZeRO-3 with ZeRO++'s options, in units of M."""

    forward_allgather: float
    """Weights gathered for forward: 1, or 0.5 with qwZ."""
    backward_allgather: float
    """Weights gathered for backward: 1, or 0 with hpZ (gathered from the in-node secondary copy)."""
    gradient_reduce: float
    """Gradient reduce-scatter: 1, or 0.25 with qgZ."""

    @property
    def total(self) -> float:
        return self.forward_allgather + self.backward_allgather + self.gradient_reduce


def zeropp_cross_node_traffic(*, hpz: bool, qwz: bool, qgz: bool) -> ZeroPPTraffic:
    """ZeRO++ §3: each collective's cross-node volume in units of M (3M for plain ZeRO-3)."""
    return ZeroPPTraffic(
        forward_allgather=QWZ_FACTOR if qwz else 1.0,
        backward_allgather=0.0 if hpz else 1.0,
        gradient_reduce=QGZ_FACTOR if qgz else 1.0,
    )


def hpz_secondary_bytes(total_params: int, *, bytes_per_param: int, hpz_partition_size: int) -> int:
    """Bytes per GPU of hpZ's secondary weight partition (§3.2): the 16-bit weights split over the
    ``hpz_partition_size`` ranks of a node (0 when hpZ is off, size 1)."""
    if hpz_partition_size <= 1:
        return 0
    return -(-total_params * bytes_per_param // hpz_partition_size)
