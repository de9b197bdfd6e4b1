"""Measurements one process makes on its device (torch imported inside each function).

Each returns plain numbers with the sizes used, so the profile's ``[calibration]`` table says how
it was measured. Timings are medians of repeated calls after a warm-up call, synchronised on
CUDA. On CPU the "device" is this process's share of the CPU (the worker sets the thread count
the probe launcher would: cores / processes).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = [
    "Timing",
    "time_call",
    "matmul_flops",
    "memory_bandwidth",
    "host_copy_bandwidth",
    "adam_throughput",
    "workload_flops",
    "engine_step_times",
]

_DTYPES = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Timing:
    """Median and fastest seconds of one call, and how many calls were timed."""

    seconds: float
    """Median of the timed calls (typical)."""
    calls: int
    """Calls timed (after one warm-up call)."""
    fastest: float = 0.0
    """Fastest timed call (least disturbed by other processes)."""


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: Any, *, budget_s: float, min_calls: int = 3, max_calls: int = 1000) -> Timing:
    """Median wall time of ``fn()`` after one warm-up call, repeating until ``budget_s`` is spent."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = time.perf_counter() - t0
    calls = int(min(max_calls, max(min_calls, budget_s / max(first, 1e-7))))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return Timing(seconds=statistics.median(times), calls=calls, fastest=min(times))


def torch_dtype(precision: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]


def matmul_flops(precision: str, device: Any, *, budget_s: float, max_n: int) -> tuple[float, int]:
    """Dense square matmul FLOP/s (2·n³ per product) in ``precision``; returns (FLOP/s, n).

    n grows from 256 by doubling while one product takes under a tenth of the budget, so slow
    precisions (fp16 on CPUs without fp16 units) stay cheap and fast ones reach a large size.
    The fastest call counts: a peak is what the unit can do when nothing else disturbs it (on a
    shared machine the median drifts with other users' load).
    """
    import torch

    dtype = torch_dtype(precision)
    n = 256
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        timing = time_call(lambda: torch.mm(a, b, out=out), device, budget_s=budget_s / 4, min_calls=2)
        if timing.seconds > budget_s / 10 or n * 2 > max_n:
            break
        n *= 2
    timing = time_call(lambda: torch.mm(a, b, out=out), device, budget_s=budget_s / 2, min_calls=3)
    return 2.0 * n**3 / timing.fastest, n


def memory_bandwidth(device: Any, *, size_bytes: int, budget_s: float) -> float:
    """Device memory bandwidth, bytes/s: a buffer copy reads and writes S bytes (STREAM "copy", 2·S)."""
    import torch

    src = torch.empty(size_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    timing = time_call(lambda: dst.copy_(src), device, budget_s=budget_s)
    return 2.0 * size_bytes / timing.seconds


def host_copy_bandwidth(device: Any, *, size_bytes: int, budget_s: float) -> dict[str, float]:
    """Host↔device copy bandwidth, bytes/s (S / t, one direction).

    On CUDA: host→device and device→host from pinned and from pageable host memory. On CPU there
    is no separate device: the figure is a host memcpy of S bytes (what offloading "moves").
    """
    import torch

    n = size_bytes // 4
    if device.type != "cuda":
        src = torch.empty(n, dtype=torch.float32).fill_(1.0)
        dst = torch.empty_like(src)
        t = time_call(lambda: dst.copy_(src), device, budget_s=budget_s).seconds
        return {"memcpy": size_bytes / t}
    dev = torch.empty(n, dtype=torch.float32, device=device)
    out: dict[str, float] = {}
    for kind in ("pinned", "pageable"):
        host = torch.empty(n, dtype=torch.float32, pin_memory=kind == "pinned")
        out[f"h2d_{kind}"] = size_bytes / time_call(lambda: dev.copy_(host, non_blocking=True), device, budget_s=budget_s / 4).seconds
        out[f"d2h_{kind}"] = size_bytes / time_call(lambda: host.copy_(dev, non_blocking=True), device, budget_s=budget_s / 4).seconds
    return out


def adam_throughput(*, params: int, budget_s: float, use_deepspeed: bool) -> tuple[float, str]:
    """Host Adam steps, parameters per second, on fp32 CPU tensors (the ZeRO-Offload optimizer step).

    ``use_deepspeed``: DeepSpeed's ``DeepSpeedCPUAdam`` (vectorised C++, what offload runs) if its
    op loads, else ``torch.optim.AdamW`` (foreach). Returns (params/s, implementation used).
    """
    import torch

    device = torch.device("cpu")
    p = torch.nn.Parameter(torch.zeros(params, dtype=torch.float32))
    p.grad = torch.full_like(p, 1e-3)
    name = "torch.optim.AdamW"
    opt = None
    if use_deepspeed:
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            opt = DeepSpeedCPUAdam([p], lr=1e-4, adamw_mode=True)
            name = "deepspeed.ops.adam.DeepSpeedCPUAdam"
        except Exception as exc:  # the op build can fail in many ways (compiler, headers, ISA)
            name = f"torch.optim.AdamW (DeepSpeedCPUAdam unavailable: {type(exc).__name__})"
            opt = None
    if opt is None:
        opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
    timing = time_call(opt.step, device, budget_s=budget_s, min_calls=3)
    return params / timing.seconds, name


def workload_flops(
    *, build_model: Callable[[], Any], make_batch: Callable[[int], Any], loss_fn: Callable[[Any, Any], Any],
    flops_per_step: float, precision: str, device: Any, budget_s: float,
) -> tuple[float, float]:
    """Achieved FLOP/s of forward + backward of a real model; returns (FLOP/s, seconds per step).

    ``flops_per_step`` comes from the estimator's own FLOP count (6·N + 12·L·h·s per token), so
    efficiency = achieved / peak is exactly the factor the time model multiplies peak by.
    """
    import torch

    dtype = torch_dtype(precision)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = build_model().to(device)
    finally:
        torch.set_default_dtype(previous)
    model.train()
    batch = make_batch(0)
    batch = tuple(t.to(device) for t in batch) if isinstance(batch, (tuple, list)) else batch.to(device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()

    timing = time_call(step, device, budget_s=budget_s, min_calls=2)
    return flops_per_step / timing.seconds, timing.seconds


def engine_step_times(
    *, build_model: Callable[[], Any], make_batch: Callable[[int, int], Any], loss_fn: Callable[[Any, Any], Any],
    ds_config: dict, micro_batches: tuple[int, int], warmup: int, repeats: int,
) -> dict[int, list[float]]:
    """Seconds per DeepSpeed optimizer step (forward, ``engine.backward``, ``engine.step``) at each micro-batch.

    Runs in an initialised process group (every rank calls it with the same arguments). After
    ``warmup`` steps at each size, ``repeats`` rounds alternate the two sizes (lo, hi, then
    hi, lo, ...) so a change of load on a shared machine hits both alike. The engine is freed
    before returning.
    """
    import gc

    import deepspeed
    import torch

    model = build_model()
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config
    )
    batches = {}
    for mb in micro_batches:
        batch = make_batch(mb, 0)
        batches[mb] = tuple(t.to(engine.device) for t in batch) if isinstance(batch, (tuple, list)) else batch.to(engine.device)

    def one(mb: int) -> float:
        t0 = time.perf_counter()
        loss = loss_fn(engine, batches[mb])
        engine.backward(loss)
        engine.step()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        return time.perf_counter() - t0

    for _ in range(warmup):
        for mb in micro_batches:
            one(mb)
    times: dict[int, list[float]] = {mb: [] for mb in micro_batches}
    for i in range(repeats):
        for mb in (micro_batches if i % 2 == 0 else tuple(reversed(micro_batches))):
            times[mb].append(one(mb))
    engine.destroy() if hasattr(engine, "destroy") else None
    del engine, model
    gc.collect()
    return times
