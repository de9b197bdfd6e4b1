"""The time model for probes that run on this machine's CPU: measured speeds, not a GPU datasheet.

When ``tune`` runs its probes on CPU (no CUDA device) and no ``--gpu`` profile was given, the
estimator's predictions, which order the search, would otherwise use the default GPU's datasheet
(an A100): compute 1000× faster than these cores, so per-step overheads and collectives would
weigh wrongly against compute. :func:`quick_cpu_profile` measures, in about two seconds and with
the thread share one of ``ranks`` probe processes gets, what ``zeroplan calibrate --quick``
measures first — dense matmul FLOP/s per precision and memory bandwidth (the same functions,
:mod:`zeroplan.calibrate.measure`) — and returns the base profile with those speeds; its memory
size, which the estimator's pruning uses, is left as it was. A profile from ``zeroplan calibrate``
(``--gpu profile.toml``) is better and is used as given.

Quantities the quick measurement does not take, with the value used instead:

* collectives between ranks (gloo over shared memory): bandwidth = the measured memory bandwidth
  / 2 (each byte is written into and read out of a shared buffer), latency 100 µs;
* host↔device copies: the measured memory bandwidth (host and "device" are one memory);
* efficiency (fraction of the matmul peak a small transformer step reaches): 0.3;
* the offloaded (host) Adam runs at the rate the estimator gives the device's Adam on this
  memory bandwidth: on a CPU-only machine "device" and host are the same cores and memory, so
  offloading the optimizer must not look faster than keeping it.
"""

from __future__ import annotations

import os
from dataclasses import replace

from zeroplan.estimator.timing import _GPU_ADAM_BYTES_PER_PARAM
from zeroplan.spec import ClusterSpec, GpuSpec

__all__ = ["quick_cpu_profile", "time_model_for_probes", "CPU_EFFICIENCY", "GLOO_LATENCY_S"]

#: Fraction of the matmul peak a small transformer step reaches on CPU (assumed; calibrate measures it).
CPU_EFFICIENCY = 0.3
#: Per-collective latency of gloo between processes on one machine, seconds (assumed).
GLOO_LATENCY_S = 1e-4


def quick_cpu_profile(base: GpuSpec, *, ranks: int, budget_s: float = 2.0) -> tuple[GpuSpec, str]:
    """``base`` with this CPU's speeds as one of ``ranks`` probe processes sees them, and a note."""
    import torch

    from zeroplan.calibrate.measure import matmul_flops, memory_bandwidth

    cores = os.cpu_count() or 1
    threads = max(1, cores // max(ranks, 1))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        device = torch.device("cpu")
        flops = {prec: matmul_flops(prec, device, budget_s=budget_s / 5, max_n=1024)[0] for prec in ("fp32", "bf16", "fp16")}
        bandwidth = memory_bandwidth(device, size_bytes=64 * 2**20, budget_s=budget_s / 5)
    finally:
        torch.set_num_threads(before)
    spec = replace(
        base,
        name="cpu-quick",
        display_name=f"this CPU ({cores} cores, {threads} threads per rank)",
        source="zeroplan tune quick CPU measurement (matmul, copy)",
        peak_flops=flops,
        memory_bandwidth=bandwidth,
        intra_node_bandwidth=bandwidth / 2,
        inter_node_bandwidth=bandwidth / 2,
        host_bandwidth=bandwidth,
        efficiency=CPU_EFFICIENCY,
        cpu_adam_params_per_s=bandwidth / _GPU_ADAM_BYTES_PER_PARAM,
        collective_latency_s=GLOO_LATENCY_S,
    )
    note = (
        f"time model: this CPU measured now ({flops['fp32'] / 1e9:.0f} GFLOP/s fp32, {flops['bf16'] / 1e9:.0f} bf16 per rank, "
        f"{bandwidth / 1e9:.1f} GB/s copy), not the {base.name} datasheet; give --gpu PROFILE.toml from zeroplan calibrate for a full one"
    )
    return spec, note


def time_model_for_probes(cluster: ClusterSpec, *, on_cuda: bool, gpu_given: bool) -> tuple[ClusterSpec, str]:
    """The cluster whose speeds order the search, and a line saying which time model it is.

    On CUDA, or with a ``--gpu`` profile given, ``cluster`` as is; on CPU without one, the
    :func:`quick_cpu_profile` of this machine (memory sizes unchanged).
    """
    if on_cuda or gpu_given:
        name = cluster.gpu.display_name or cluster.gpu.name
        return cluster, f"time model: {name} ({cluster.gpu.source or 'profile'})"
    spec, note = quick_cpu_profile(cluster.gpu, ranks=cluster.gpus_per_node)
    return replace(cluster, gpu=spec, gpu_memory_bytes=cluster.gpu_memory_bytes or cluster.gpu.memory_bytes), note
