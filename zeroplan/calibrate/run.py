"""``calibrate()``: measure this machine with N worker processes and build a GPU profile.

All measurements run in N spawned processes at once (gloo on CPU, NCCL on CUDA), each on its
own device — on a CPU-only machine each process gets cores/N threads, as the probe launcher
gives each rank — so every figure is what one "GPU" of an N-process job gets while the others
are busy too. Rank 0 reports progress through a queue; the parent draws the progress bar and
builds the :class:`~zeroplan.spec.GpuSpec`. Nothing is written here: the CLI writes the profile
atomically once everything has been measured.
"""

from __future__ import annotations

import datetime
import os
import platform
import queue as queue_mod
import socket
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroplan.calibrate.fit import CollectiveFit, fit_latency_bandwidth, ring_bytes
from zeroplan.spec import GpuSpec, SpecError

__all__ = ["CalibrationOptions", "CalibrationResult", "CalibrationError", "calibrate", "default_processes", "planned_steps"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


class CalibrationError(RuntimeError):
    """A measurement process failed (the machine, not the input): the CLI exits 1."""


@dataclass(frozen=True)
class CalibrationOptions:
    """What to measure and how long to spend on it."""

    processes: int = 2
    """Worker processes (GPUs on CUDA; ranks sharing the CPU otherwise)."""
    quick: bool = False
    """Smaller sizes and shorter timings, engine at stage 2 only (on a 2-core CPU with the ops built: about 65 s in bf16, whose CPU matmuls are slow, 28 s with precision fp32)."""
    device: str = "auto"
    """``auto`` (CUDA if available), ``cuda`` or ``cpu``."""
    precision: str = "bf16"
    """Precision of the transformer workload that measures efficiency."""
    task: str | None = None
    """A zeroplan task script to measure efficiency on instead of the built-in GPT."""
    micro_batch: int = 4
    """Samples per step of the efficiency workload."""
    use_deepspeed_adam: bool | None = None
    """DeepSpeedCPUAdam for the Adam timing: None = if its op is already built (always outside --quick)."""
    engine: bool = True
    """Time real DeepSpeed engine steps for ``step_overhead_s`` and the engine's per-sample cost."""

    def __post_init__(self) -> None:
        if isinstance(self.processes, bool) or not isinstance(self.processes, int) or not 1 <= self.processes <= 64:
            raise SpecError(f"--gpus {self.processes!r} is not valid for calibrate; give 1 to 64 processes")
        if self.device not in ("auto", "cuda", "cpu"):
            raise SpecError(f"device={self.device!r} is not valid; choose auto, cuda or cpu")
        if self.precision not in ("bf16", "fp16", "fp32"):
            raise SpecError(f"--precision {self.precision!r} is not valid; choose bf16, fp16 or fp32")
        if self.task is not None and not Path(self.task).is_file():
            raise SpecError(f"--task {self.task}: no such file; give a zeroplan task script (see examples/gpt_task.py)")
        if isinstance(self.micro_batch, bool) or not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise SpecError(f"--micro-batch {self.micro_batch!r} is not valid; give a whole number >= 1")

    @property
    def budget_s(self) -> float:
        """Seconds of timing per measured quantity."""
        return 0.4 if self.quick else 1.5

    @property
    def engine_stages(self) -> tuple[int, ...]:
        """ZeRO stages whose engine steps are timed (none without ``engine``)."""
        if not self.engine:
            return ()
        return (2,) if self.quick else (0, 1, 2, 3)

    @property
    def engine_micro_batches(self) -> tuple[int, int]:
        """The two micro-batches of the engine timing (fixed cost = intercept of the line through them)."""
        return (1, max(2, self.micro_batch))

    @property
    def engine_warmup(self) -> int:
        """Untimed rounds per stage before timing (the first steps allocate and build caches)."""
        return 1 if self.quick else 2

    @property
    def engine_repeats(self) -> int:
        """Timed rounds per stage (one step at each micro-batch per round)."""
        return 3 if self.quick else 5

    @property
    def collective_sizes(self) -> tuple[int, ...]:
        """Buffer sizes (bytes) of the collective sweep."""
        if self.quick:
            return (2**12, 2**17, 2**22)
        return tuple(2**k for k in range(10, 27, 2))


@dataclass(frozen=True)
class CalibrationResult:
    """The profile and how each number was measured."""

    gpu: GpuSpec
    """The measured profile (write it with ``zeroplan.profiles.write_gpu_toml``)."""
    calibration: dict[str, Any]
    """Flat table of measurement details for the profile's ``[calibration]`` section."""
    collective_fits: dict[str, CollectiveFit] = field(default_factory=dict)
    """Per collective, and ``all`` for the joint fit the profile uses."""


def planned_steps(options: CalibrationOptions) -> list[str]:
    """Labels of the progress steps, in order (the worker reports one event per label)."""
    steps = [f"matmul {p}" for p in ("bf16", "fp16", "fp32")]
    steps += ["memory bandwidth", "host copy"]
    if options.processes > 1:
        steps += [f"{c} {s} B" for c in COLLECTIVES for s in options.collective_sizes]
    steps += ["CPU Adam", "transformer step"]
    steps += [f"engine stage {s}" for s in options.engine_stages]
    return steps


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_adam_built() -> bool:
    """DeepSpeed's cpu_adam op is already compiled in torch's extension cache (loading is then fast)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return (Path(_get_build_directory("cpu_adam", verbose=False)) / "cpu_adam.so").exists()
    except Exception:  # private helper; any failure just means "not known to be built"
        return False


def default_processes(device: str) -> int:
    """Processes to measure with when ``--gpus`` is not given: this machine's CUDA devices (unless
    ``device`` is cpu), else 2 ranks sharing the CPU."""
    import torch

    return torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 2


def calibrate(options: CalibrationOptions, *, progress: bool = True) -> CalibrationResult:
    """Run the measurements in ``options.processes`` workers and return the profile."""
    import multiprocessing as mp

    import torch

    use_cuda = options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise SpecError("--device cuda: no CUDA device is available here; use --device cpu")
    if use_cuda and options.processes > torch.cuda.device_count():
        raise SpecError(
            f"--gpus {options.processes} but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    use_ds_adam = options.use_deepspeed_adam
    if use_ds_adam is None:
        use_ds_adam = (not options.quick) or _cpu_adam_built()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // options.processes)
    config = {
        "world_size": options.processes,
        "port": _free_port(),
        "cuda": use_cuda,
        "threads": threads,
        "budget_s": options.budget_s,
        "sizes": list(options.collective_sizes),
        "quick": options.quick,
        "precision": options.precision,
        "task": options.task,
        "micro_batch": options.micro_batch,
        "use_ds_adam": use_ds_adam,
        "engine_stages": list(options.engine_stages),
        "engine_micro_batches": list(options.engine_micro_batches),
        "engine_repeats": options.engine_repeats,
        "engine_warmup": options.engine_warmup,
    }
    steps = planned_steps(options)
    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    from zeroplan.calibrate.worker import worker_main

    procs = [ctx.Process(target=worker_main, args=(rank, config, events), daemon=True) for rank in range(options.processes)]
    result: dict | None = None
    try:
        for p in procs:
            p.start()
        result = _follow(procs, events, steps, show=progress)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return _build_result(result, options, config, cores)


def _follow(procs: list, events: Any, steps: list[str], *, show: bool) -> dict:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("[bold]calibrate[/bold] {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not show,
    ) as bar:
        task = bar.add_task("starting workers", total=len(steps))
        while True:
            try:
                kind, payload = events.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise CalibrationError(f"a calibration process exited with code {dead[0].exitcode}")
                if all(p.exitcode == 0 for p in procs):
                    raise CalibrationError("calibration processes ended without a result")
                continue
            if kind == "step":
                bar.update(task, advance=1, description=payload)
            elif kind == "error":
                raise CalibrationError(payload)
            elif kind == "result":
                bar.update(task, completed=len(steps))
                return payload


def _build_result(result: dict, options: CalibrationOptions, config: dict, cores: int) -> CalibrationResult:
    import torch

    n = options.processes
    samples = result.get("collectives", [])
    fits: dict[str, CollectiveFit] = {}
    if n > 1 and samples:
        for c in COLLECTIVES:
            own = [s for s in samples if s[0] == c]
            if len(own) >= 2:
                fits[c] = fit_latency_bandwidth(own, n)
        fits["all"] = fit_latency_bandwidth(samples, n)
    peak = {p: result["matmul"][p]["flops"] for p in ("bf16", "fp16", "fp32")}
    efficiency = result["workload"]["flops"] / peak[options.precision]
    host = result["host_copy"]
    host_bw = statistics.mean([host["h2d_pinned"], host["d2h_pinned"]]) if config["cuda"] else host["memcpy"]
    if "all" in fits:
        bus_bw, alpha = fits["all"].bandwidth, fits["all"].latency_s
    else:
        # One process: no collective to time; the estimator ignores collectives at N = 1.
        bus_bw, alpha = result["memory_bandwidth"], 0.0
    device_name = result["device_name"]
    host_name = platform.node() or "localhost"
    kind = "cuda" if config["cuda"] else "cpu"
    name = f"calibrated-{kind}-{host_name}".lower().replace(" ", "-")
    today = datetime.date.today().isoformat()
    source = (
        f"zeroplan calibrate{' --quick' if options.quick else ''} on {host_name}, {today}: {n} process(es) "
        f"({'nccl' if config['cuda'] else 'gloo'}), torch {torch.__version__}"
        + ("" if config["cuda"] else f", {config['threads']} thread(s) each of {cores} cores; the CPU stands in for the GPU")
        + "; inter-node bandwidth not measured (one node): set to the intra-node figure"
    )
    memory_bytes = result["memory_bytes"]
    gpu = GpuSpec(
        name=name,
        display_name=device_name,
        memory_bytes=int(memory_bytes),
        peak_flops={p: float(v) for p, v in peak.items()},
        memory_bandwidth=float(result["memory_bandwidth"]),
        intra_node_bandwidth=float(bus_bw),
        host_bandwidth=float(host_bw),
        inter_node_bandwidth=float(bus_bw),
        source=source,
        efficiency=float(min(max(efficiency, 1e-6), 1.0)),
        cpu_adam_params_per_s=float(result["adam"]["params_per_s"]),
        collective_latency_s=float(min(alpha, 1.0)),
        comm_stream=bool(config["cuda"]),  # a CPU has no side stream (DeepSpeed: is_synchronized_device)
    )
    cal: dict[str, Any] = {
        "date": today,
        "quick": options.quick,
        "processes": n,
        "device": kind,
        "threads_per_process": config["threads"] if not config["cuda"] else 0,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
    for p in ("bf16", "fp16", "fp32"):
        cal[f"matmul_{p}_n"] = result["matmul"][p]["n"]
    cal["memory_copy_bytes"] = result["memory_copy_bytes"]
    for k, v in host.items():
        cal[f"host_{k}_bytes_per_s"] = float(v)
    for c, fit in fits.items():
        cal[f"{c}_bus_bandwidth"] = fit.bandwidth
        cal[f"{c}_latency_s"] = fit.latency_s
        cal[f"{c}_fit_max_residual"] = fit.max_relative_residual
    cal["adam_implementation"] = result["adam"]["implementation"]
    cal["adam_params"] = result["adam"]["params"]
    cal["efficiency_workload"] = result["workload"]["name"]
    cal["efficiency_precision"] = options.precision
    cal["efficiency_step_s"] = result["workload"]["step_s"]
    cal["efficiency_flops_per_s"] = result["workload"]["flops"]
    cal["efficiency_unclamped"] = efficiency
    gpu = _engine_terms(gpu, result.get("engine"), options, cal)
    return CalibrationResult(gpu=gpu, calibration=cal, collective_fits=fits)


def _engine_terms(gpu: GpuSpec, engine: dict | None, options: CalibrationOptions, cal: dict[str, Any]) -> GpuSpec:
    """``step_overhead_s`` (and the engine's efficiency) from the DeepSpeed engine timings.

    Per stage, the step times at two micro-batches give t = fixed + mb · per_sample
    (:func:`~zeroplan.calibrate.fit.fixed_and_per_sample`). The time model has its own fixed
    terms (collectives, optimizer step): the estimator's prediction for the same plan, with this
    profile and no overhead, is split the same way, and the overhead is what the engine spends
    beyond it: measured fixed − predicted fixed. The profile takes the median over the stages.
    The engine's per-sample cost is the compute of one sample as the engine runs it; efficiency
    becomes FLOPs per sample / (per_sample · peak), so the fixed cost is not counted twice (a
    plain forward + backward at one micro-batch folds its own per-step cost into efficiency).
    """
    import dataclasses

    from zeroplan.calibrate.fit import fixed_and_per_sample

    if not options.engine:
        cal["engine"] = "skipped (--no-engine-steps): step_overhead_s = 0"
        return gpu
    if not engine or "error" in engine:
        cal["engine"] = f"not measured: {engine.get('error') if engine else 'no result'}; step_overhead_s = 0"
        return gpu
    import psutil

    from zeroplan.estimator import estimate_plan
    from zeroplan.estimator.timing import flops_per_token
    from zeroplan.spec import ClusterSpec, ModelSpec, Plan, TrainingSpec

    spec = ModelSpec.from_dict(engine["model_spec"])
    training = TrainingSpec(precision=options.precision, seq_len=engine["seq_len"])
    lo, hi = engine["micro_batches"]
    flops_per_sample = engine["seq_len"] * sum(flops_per_token(spec, training, Plan(stage=0, micro_batch=1)).values())
    measured = {}
    for stage, by_mb in engine["stages"].items():
        measured[int(stage)] = fixed_and_per_sample({int(mb): ts for mb, ts in by_mb.items()})
    # The per-sample cost is read where the step is a straight line in the micro-batch: stage 0
    # reduces after backward (engine.allreduce_gradients); with a side stream (a GPU), stages 1-2
    # with overlap_comm and stage 3's prefetch hide communication behind a backward whose length
    # grows with the micro-batch (zeroplan.estimator.overlap), which bends the line. A CPU hides
    # nothing: every stage is a line there.
    linear = [stage for stage in measured if stage == 0 or not gpu.comm_stream] or list(measured)
    cal["engine_per_sample_stages"] = sorted(linear)
    per_sample = statistics.median(measured[stage][1] for stage in linear)
    cal["engine"] = (
        f"DeepSpeed engine steps of {engine['name']} at micro-batch {lo} and {hi}, "
        f"{options.engine_repeats} alternating rounds after {options.engine_warmup} warm-up round(s), slowest rank, medians"
    )
    cal["efficiency_plain"] = gpu.efficiency
    if per_sample > 0:
        achieved = flops_per_sample / per_sample
        engine_eff = achieved / gpu.peak_flops[options.precision]
        cal["engine_efficiency_unclamped"] = engine_eff
        if engine_eff > 1.0:
            # The engine ran faster than the matmul peak measured earlier: that timing was disturbed
            # (a shared machine); the engine's own FLOP/s is a lower bound on the peak.
            cal[f"peak_flops_{options.precision}_matmul"] = gpu.peak_flops[options.precision]
            cal[f"peak_flops_{options.precision}_source"] = "raised to the engine's achieved FLOP/s (matmul timing was disturbed)"
            gpu = dataclasses.replace(gpu, peak_flops={**gpu.peak_flops, options.precision: float(achieved)}, efficiency=1.0)
        else:
            gpu = dataclasses.replace(gpu, efficiency=float(max(engine_eff, 1e-6)))
        cal["efficiency_source"] = "engine per-sample cost"
    else:
        cal["efficiency_source"] = "plain forward + backward (engine per-sample cost not positive: too noisy)"
    cluster = ClusterSpec(
        gpus=options.processes, gpus_per_node=options.processes, gpu=dataclasses.replace(gpu, step_overhead_s=0.0, stage3_layer_overhead_s=0.0),
        cpu_memory_per_node_bytes=int(psutil.virtual_memory().total),
    )
    overheads = []
    for stage, (fixed, ps) in sorted(measured.items()):
        predicted = {
            mb: [estimate_plan(spec, cluster, training, Plan(stage=stage, micro_batch=mb)).step_time] for mb in (lo, hi)
        }
        predicted_fixed, _ = fixed_and_per_sample(predicted)
        overheads.append(fixed - predicted_fixed)
        cal[f"engine_stage{stage}_step_s"] = [statistics.median(engine["stages"][str(stage)][str(mb)]) for mb in (lo, hi)]
        cal[f"engine_stage{stage}_fixed_s"] = fixed
        cal[f"engine_stage{stage}_per_sample_s"] = ps
        cal[f"engine_stage{stage}_predicted_fixed_s"] = predicted_fixed
        cal[f"engine_stage{stage}_overhead_s"] = fixed - predicted_fixed
    overhead = max(0.0, statistics.median(overheads))
    cal["engine_overhead_median_s"] = overhead
    cal["engine_model_layers"] = spec.num_layers
    by_stage = {stage: fixed - cal[f"engine_stage{stage}_predicted_fixed_s"] for stage, (fixed, _) in measured.items()}
    if 3 in by_stage and len(by_stage) > 1:
        # Stage 3's per-module gather/release hooks: its extra over the other stages, per layer and
        # micro-step (the profile has one overhead; the time model may use this split later).
        base = statistics.median(v for k, v in by_stage.items() if k != 3)
        cal["engine_overhead_stage012_median_s"] = base
        cal["engine_stage3_extra_s"] = by_stage[3] - base
        cal["engine_stage3_extra_per_layer_s"] = (by_stage[3] - base) / spec.num_layers
        # The time model adds stage 3's hooks per layer and micro-step on top of the base overhead.
        return dataclasses.replace(
            gpu,
            step_overhead_s=float(min(max(0.0, base), 3600.0)),
            stage3_layer_overhead_s=float(min(max(0.0, (by_stage[3] - base) / spec.num_layers), 60.0)),
        )
    return dataclasses.replace(gpu, step_overhead_s=float(min(overhead, 3600.0)))


def collective_table(samples: list[tuple[str, int, float]], world_size: int) -> list[tuple[str, int, float, float]]:
    """(collective, bytes, seconds, bus bytes/s) rows for display."""
    return [(c, s, t, ring_bytes(c, s, world_size) / t) for c, s, t in samples]
