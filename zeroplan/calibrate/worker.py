"""Body of one calibration process (spawned by :func:`zeroplan.calibrate.run.calibrate`)."""

from __future__ import annotations

import logging
import os
import platform
import statistics
import time
import traceback
from typing import Any

__all__ = ["worker_main"]


def worker_main(rank: int, config: dict, events: Any) -> None:
    """Measure, gather to rank 0, post ("result", dict); on failure post ("error", one line)."""
    # The parent may print the profile on stdout: library chatter (DeepSpeed's op builder and
    # logger) from these processes goes to stderr instead.
    try:
        os.dup2(2, 1)
    except OSError:
        pass
    try:
        _run(rank, config, events)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # reported to the parent as one line; the traceback goes to stderr
        traceback.print_exc()
        events.put(("error", f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _run(rank: int, config: dict, events: Any) -> None:
    if not config["cuda"]:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # As the probe launcher does: each rank gets its share of the cores, for torch and for the
    # OpenMP loops of DeepSpeed's CPU Adam alike.
    os.environ["OMP_NUM_THREADS"] = str(config["threads"])
    import torch
    import torch.distributed as dist

    from zeroplan.calibrate import measure

    world = config["world_size"]
    torch.set_num_threads(config["threads"])
    if config["cuda"]:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if config["cuda"] else "gloo",
        init_method=f"tcp://127.0.0.1:{config['port']}",
        rank=rank,
        world_size=world,
    )
    budget = config["budget_s"]

    def step(label: str) -> None:
        if rank == 0:
            events.put(("step", label))

    local: dict[str, Any] = {"matmul": {}}
    max_n = 8192 if config["cuda"] else 2048
    for precision in ("bf16", "fp16", "fp32"):
        dist.barrier()
        flops, n = measure.matmul_flops(precision, device, budget_s=budget, max_n=max_n)
        local["matmul"][precision] = {"flops": flops, "n": n}
        step(f"matmul {precision}")

    copy_bytes = (256 if config["cuda"] else 64) * 2**20 if config["quick"] else (1024 if config["cuda"] else 256) * 2**20
    dist.barrier()
    local["memory_bandwidth"] = measure.memory_bandwidth(device, size_bytes=copy_bytes, budget_s=budget)
    step("memory bandwidth")
    dist.barrier()
    local["host_copy"] = measure.host_copy_bandwidth(device, size_bytes=copy_bytes, budget_s=budget)
    step("host copy")

    samples: list[tuple[str, int, float]] = []
    if world > 1:
        for collective in ("all_reduce", "all_gather", "reduce_scatter"):
            for size in config["sizes"]:
                seconds = _time_collective(collective, size, world, device, budget / 2)
                samples.append((collective, size, seconds))
                step(f"{collective} {size} B")

    dist.barrier()
    # Larger than the last-level cache (4 fp32 arrays of 64 or 256 MiB), as a real shard is.
    adam_params = 2**24 if config["quick"] else 2**26
    params_per_s, implementation = measure.adam_throughput(
        params=adam_params, budget_s=budget, use_deepspeed=config["use_ds_adam"]
    )
    local["adam"] = {"params_per_s": params_per_s, "implementation": implementation, "params": adam_params}
    step("CPU Adam")

    dist.barrier()
    local["workload"] = _workload(config, device, rank, budget * 2)
    step("transformer step")

    if config["engine_stages"]:
        dist.barrier()
        local["engine"] = _engine(config, rank, world, step)
        if "error" in local["engine"]:
            for stage in config["engine_stages"]:
                step(f"engine stage {stage}")

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, local)
    if rank == 0:
        med = statistics.median
        result = {
            "matmul": {
                p: {"flops": med(g["matmul"][p]["flops"] for g in gathered), "n": gathered[0]["matmul"][p]["n"]}
                for p in ("bf16", "fp16", "fp32")
            },
            "memory_bandwidth": med(g["memory_bandwidth"] for g in gathered),
            "memory_copy_bytes": copy_bytes,
            "host_copy": {k: med(g["host_copy"][k] for g in gathered) for k in gathered[0]["host_copy"]},
            "collectives": samples,
            "adam": {**gathered[0]["adam"], "params_per_s": med(g["adam"]["params_per_s"] for g in gathered)},
            "workload": {**gathered[0]["workload"], "flops": med(g["workload"]["flops"] for g in gathered),
                         "step_s": med(g["workload"]["step_s"] for g in gathered)},
            "engine": _merge_engine([g.get("engine") for g in gathered]),
            "device_name": torch.cuda.get_device_name(device) if config["cuda"] else _cpu_name(),
            "memory_bytes": _memory_bytes(device, config["cuda"]),
        }
        events.put(("result", result))
    dist.barrier()
    dist.destroy_process_group()


def _merge_engine(per_rank: list[Any]) -> dict[str, Any] | None:
    """Rank 0's engine record with each step time replaced by the slowest rank's (as probes report)."""
    first = per_rank[0]
    if not first or "error" in first:
        return first
    merged = {**first, "stages": {}}
    for stage, by_mb in first["stages"].items():
        merged["stages"][stage] = {
            mb: [max(r["stages"][stage][mb][i] for r in per_rank) for i in range(len(ts))] for mb, ts in by_mb.items()
        }
    return merged


def _memory_bytes(device: Any, cuda: bool) -> int:
    if cuda:
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory)
    import psutil

    return int(psutil.virtual_memory().total)


def _time_collective(collective: str, size: int, world: int, device: Any, budget_s: float) -> float:
    """Median seconds of one call on the slowest rank; every rank makes the same number of calls."""
    import torch
    import torch.distributed as dist

    elems = max(world, size // 4 // world * world)
    full = torch.ones(elems, dtype=torch.float32, device=device)
    part = torch.empty(elems // world, dtype=torch.float32, device=device)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if collective == "all_reduce":
        call = lambda: dist.all_reduce(full)  # noqa: E731
    elif collective == "all_gather":
        call = lambda: all_gather(full, part)  # noqa: E731
    else:
        call = lambda: reduce_scatter(part, full)  # noqa: E731

    def timed() -> float:
        t0 = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    dist.barrier()
    timed()  # warm-up (connection set-up, allocator)
    first = torch.tensor([timed()], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX)
    calls = int(min(200, max(3, budget_s / max(first.item(), 1e-6))))
    times = []
    for _ in range(calls):
        times.append(timed())
    median = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def _workload_parts(config: dict, rank: int) -> dict[str, Any]:
    """The efficiency workload: the ``--task`` script's model or the built-in GPT, with its shape."""
    if config["task"]:
        from zeroplan.trace.source import TaskSource

        task = TaskSource.from_path(config["task"]).task
        if task.model_spec is None or task.seq_len is None:
            raise ValueError(f"task {config['task']} gives no model_spec/seq_len; efficiency needs both")
        return {
            "spec": task.model_spec, "seq_len": task.seq_len, "name": f"task {config['task']}",
            "build": task.build_model, "loss_fn": task.loss_fn,
            "make": lambda mb, step: task.make_batch(mb, step, rank),
        }
    from zeroplan.calibrate.gpt import GPT, GPTShape, gpt_batch, gpt_loss, gpt_model_spec

    shape = GPTShape(layers=2, seq_len=128) if config["quick"] else GPTShape()
    return {
        "spec": gpt_model_spec(shape), "seq_len": shape.seq_len, "name": f"built-in GPT {shape.label}",
        "build": lambda: GPT(shape), "loss_fn": gpt_loss, "make": lambda mb, step: gpt_batch(shape, mb, step),
    }


def _workload(config: dict, device: Any, rank: int, budget_s: float) -> dict[str, Any]:
    """Forward + backward of a transformer; FLOPs counted with the estimator's formula."""
    from zeroplan.calibrate import measure
    from zeroplan.estimator.timing import flops_per_token
    from zeroplan.spec import Plan, TrainingSpec

    mb = config["micro_batch"]
    parts = _workload_parts(config, rank)
    spec, seq_len = parts["spec"], parts["seq_len"]
    training = TrainingSpec(precision=config["precision"], seq_len=seq_len)
    flops = mb * seq_len * sum(flops_per_token(spec, training, Plan(stage=0, micro_batch=mb)).values())
    achieved, step_s = measure.workload_flops(
        build_model=parts["build"], make_batch=lambda step: parts["make"](mb, step), loss_fn=parts["loss_fn"],
        flops_per_step=flops, precision=config["precision"], device=device, budget_s=budget_s,
    )
    return {"flops": achieved, "step_s": step_s, "name": parts["name"], "micro_batch": mb}


def _engine(config: dict, rank: int, world: int, events_step: Any) -> dict[str, Any]:
    """DeepSpeed engine steps of the workload at two micro-batches, per ZeRO stage (no offload).

    Each stage builds a fresh model and engine (the config ``zeroplan export`` writes for that
    plan) in the process group the calibration already runs, warms up, then alternates optimizer
    steps at micro-batch ``lo`` and ``hi`` (so load drift on a shared machine hits both alike).
    The engine does not check the batch size against its config, so one engine serves both.
    Returns per stage the per-rank step times; the parent fits t = fixed + mb · per_sample.
    """
    from zeroplan.calibrate.measure import engine_step_times

    os.environ.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank if config["cuda"] else 0),
        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(config["port"]),
    })
    try:
        import deepspeed.ops
        from deepspeed.accelerator import get_accelerator
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)
        if get_accelerator()._name == "cpu":
            # Training never calls the inference-only shm all-reduce op: no JIT build of it
            # (zeroplan.runtime.rank.dsops.skip_shm_comm_op says why; calibrate sits beside runtime
            # in docs/design.md's layers, so it does the same here instead of importing it).
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    except Exception as exc:  # not installed, or its import fails on this machine: same on every rank
        return {"error": f"deepspeed unavailable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"}
    from zeroplan.dsconfig import build_config
    from zeroplan.spec import Plan, TrainingSpec

    parts = _workload_parts(config, rank)
    training = TrainingSpec(precision=config["precision"], seq_len=parts["seq_len"])
    lo, hi = config["engine_micro_batches"]
    stages: dict[str, Any] = {}
    for stage in config["engine_stages"]:
        ds_config = build_config(Plan(stage=stage, micro_batch=hi), world_size=world, training=training, model=parts["spec"])
        ds_config["steps_per_print"] = 10**9
        ds_config["wall_clock_breakdown"] = False
        times = engine_step_times(
            build_model=parts["build"], make_batch=parts["make"], loss_fn=parts["loss_fn"], ds_config=ds_config,
            micro_batches=(lo, hi), warmup=config["engine_warmup"], repeats=config["engine_repeats"],
        )
        stages[str(stage)] = {str(mb): ts for mb, ts in times.items()}
        events_step(f"engine stage {stage}")
    return {
        "stages": stages, "micro_batches": [lo, hi], "seq_len": parts["seq_len"], "name": parts["name"],
        "model_spec": {k: v for k, v in parts["spec"].as_dict().items() if k != "notes"},
    }
