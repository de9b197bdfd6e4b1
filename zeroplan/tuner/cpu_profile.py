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

It also measures what DeepSpeed's per-step bookkeeping costs here
(:mod:`zeroplan.estimator.engine_work` counts it per stage from DeepSpeed's source):

* collectives between ``ranks`` processes over gloo (:func:`measure_gloo`, forked processes on
  this machine): the cost of one small all-reduce issued after a burst of compute, so it holds
  the wait for the slowest rank that every synchronisation point of a real step pays — on a
  shared CPU milliseconds, not the microseconds of back-to-back calls — and the bandwidth of a
  4 MiB all-reduce (ring: 2·S·(n−1)/n bytes sent per rank). If the processes cannot start, the
  values assumed before are used: half the memory bandwidth and 100 µs;
* one hook call (:func:`hook_call_s`): a module forward with four no-op hooks against one
  without. DeepSpeed's hook bodies do more than that (bucket copies are counted apart), so this
  is a lower bound; ``zeroplan calibrate`` measures whole engine steps.

Quantities the quick measurement does not take, with the value used instead:

* host↔device copies: the measured memory bandwidth (host and "device" are one memory);
* efficiency (fraction of the matmul peak a small transformer step reaches): 0.3;
* the offloaded (host) Adam runs at the rate the estimator gives the device's Adam on this
  memory bandwidth: on a CPU-only machine "device" and host are the same cores and memory, so
  offloading the optimizer must not look faster than keeping it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Optional

from zeroplan.estimator.timing import _GPU_ADAM_BYTES_PER_PARAM
from zeroplan.spec import ClusterSpec, GpuSpec

__all__ = ["GlooTiming", "hook_call_s", "measure_gloo", "quick_cpu_profile", "time_model_for_probes", "CPU_EFFICIENCY", "GLOO_LATENCY_S"]

#: Fraction of the matmul peak a small transformer step reaches on CPU (assumed; calibrate measures it).
CPU_EFFICIENCY = 0.3
#: Per-collective latency of gloo between processes on one machine, seconds (assumed).
GLOO_LATENCY_S = 1e-4


@dataclass(frozen=True)
class GlooTiming:
    """Collectives between probe ranks on this machine."""

    sync_s: float
    """Median seconds of a 1-element all-reduce issued after a compute burst (latency + rank skew)."""
    bandwidth: float
    """Bytes/s each rank sends in a 4 MiB all-reduce (2·S·(n−1)/n over its median time)."""


def _gloo_rank(rank: int, world: int, port: int, threads: int, rounds: int, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    small, big = torch.zeros(1), torch.zeros(2**20)
    a = torch.randn(128, 128)
    syncs, bigs = [], []
    dist.all_reduce(small)
    for _ in range(rounds):
        for _ in range(8):  # a burst of compute, as between a step's collectives
            torch.mm(a, a)
        t0 = time.perf_counter()
        dist.all_reduce(small)
        syncs.append(time.perf_counter() - t0)
    for _ in range(5):
        t0 = time.perf_counter()
        dist.all_reduce(big)
        bigs.append(time.perf_counter() - t0)
    if rank == 0:
        queue.put((statistics.median(syncs), statistics.median(bigs)))
    dist.destroy_process_group()


def measure_gloo(ranks: int, *, threads: int, rounds: int = 40, timeout_s: float = 60.0) -> Optional[GlooTiming]:
    """:class:`GlooTiming` of ``ranks`` forked processes on this machine; None if they cannot run."""
    import multiprocessing
    import socket

    if ranks < 2:
        return None
    try:
        ctx = multiprocessing.get_context("fork")
    except ValueError:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, ranks, port, threads, rounds, queue), daemon=True) for r in range(ranks)]
    for proc in procs:
        proc.start()
    try:
        sync_s, big_s = queue.get(timeout=timeout_s)
    except Exception:  # noqa: BLE001 - no result (a rank failed or hung): fall back to the assumed values
        return None
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    size = 4 * 2**20
    return GlooTiming(sync_s=sync_s, bandwidth=2 * size * (ranks - 1) / ranks / big_s)


def hook_call_s(*, calls: int = 2000) -> float:
    """Seconds one module hook call costs here: a tiny module's forward with four no-op forward
    hooks against the same forward with none (median of paired timings)."""
    import torch

    bare, hooked = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    for _ in range(2):
        hooked.register_forward_pre_hook(lambda module, args: None)
        hooked.register_forward_hook(lambda module, args, out: None)
    x = torch.zeros(1, 4)
    diffs = []
    with torch.no_grad():
        for _ in range(calls):
            t0 = time.perf_counter()
            bare(x)
            t1 = time.perf_counter()
            hooked(x)
            diffs.append((time.perf_counter() - t1) - (t1 - t0))
    return max(statistics.median(diffs) / 4, 0.0)


def quick_cpu_profile(base: GpuSpec, *, ranks: int, budget_s: float = 2.0, before_measuring=None) -> tuple[GpuSpec, str]:
    """``base`` with this CPU's speeds as one of ``ranks`` probe processes sees them, and a note.
    ``before_measuring`` is called once torch is imported, before anything is timed (to let other
    work of the caller's finish: it would share the cores being measured)."""
    from zeroplan.runtime.rank.threads import rank_threads

    cores = os.cpu_count() or 1
    threads = rank_threads(ranks, on_cuda=False)  # what each probe rank computes with
    import torch  # imported before the fork, so the ranks start at once

    if before_measuring is not None:
        before_measuring()

    # Forked before this process runs any parallel torch op (a fork after OpenMP ran can hang).
    gloo = measure_gloo(ranks, threads=threads)
    from zeroplan.calibrate.measure import matmul_flops, memory_bandwidth

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        device = torch.device("cpu")
        flops = {prec: matmul_flops(prec, device, budget_s=budget_s / 5, max_n=1024)[0] for prec in ("fp32", "bf16", "fp16")}
        bandwidth = memory_bandwidth(device, size_bytes=64 * 2**20, budget_s=budget_s / 5)
        hook_s = hook_call_s()
    finally:
        torch.set_num_threads(before)
    # collective_time charges α per ring step, n − 1 steps per call.
    latency = gloo.sync_s / max(ranks - 1, 1) if gloo else GLOO_LATENCY_S
    link = gloo.bandwidth if gloo else bandwidth / 2
    spec = replace(
        base,
        name="cpu-quick",
        display_name=f"this CPU ({cores} cores, {threads} threads per rank)",
        source="zeroplan tune quick CPU measurement (matmul, copy)",
        peak_flops=flops,
        memory_bandwidth=bandwidth,
        intra_node_bandwidth=link,
        inter_node_bandwidth=link,
        host_bandwidth=bandwidth,
        efficiency=CPU_EFFICIENCY,
        cpu_adam_params_per_s=bandwidth / _GPU_ADAM_BYTES_PER_PARAM,
        collective_latency_s=latency,
        hook_call_s=hook_s,
        comm_stream=False,  # DeepSpeed's CPU accelerator: is_synchronized_device(), no side stream
    )
    comm = (f"gloo {latency * 1e3:.2f} ms per synchronisation, {link / 1e9:.1f} GB/s" if gloo
            else f"gloo not measured (assumed {GLOO_LATENCY_S * 1e6:.0f} µs, {link / 1e9:.1f} GB/s)")
    note = (
        f"time model: this CPU measured now ({flops['fp32'] / 1e9:.0f} GFLOP/s fp32, {flops['bf16'] / 1e9:.0f} bf16 per rank, "
        f"{bandwidth / 1e9:.1f} GB/s copy, {comm}, {hook_s * 1e6:.1f} µs per hook), not the {base.name} datasheet; give --gpu PROFILE.toml from zeroplan calibrate for a full one"
    )
    return spec, note


def time_model_for_probes(cluster: ClusterSpec, *, on_cuda: bool, gpu_given: bool, before_measuring=None) -> tuple[ClusterSpec, str]:
    """The cluster whose speeds order the search, and a line saying which time model it is.

    On CUDA, or with a ``--gpu`` profile given, ``cluster`` as is; on CPU without one, the
    :func:`quick_cpu_profile` of this machine (memory sizes unchanged; ``before_measuring`` as there).
    """
    if on_cuda or gpu_given:
        name = cluster.gpu.display_name or cluster.gpu.name
        return cluster, f"time model: {name} ({cluster.gpu.source or 'profile'})"
    spec, note = quick_cpu_profile(cluster.gpu, ranks=cluster.gpus_per_node, before_measuring=before_measuring)
    return replace(cluster, gpu=spec, gpu_memory_bytes=cluster.gpu_memory_bytes or cluster.gpu.memory_bytes), note
