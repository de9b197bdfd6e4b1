"""``zeroplan calibrate``: measure this machine into a GPU profile for ``--gpu profile.toml``.

Measures, in N processes at once (one per GPU; on a CPU-only machine N ranks sharing the cores,
the CPU standing in for the GPU): dense matmul FLOP/s per precision, device memory bandwidth,
all-reduce / all-gather / reduce-scatter times at several sizes fitted to α + S/B, host↔device
copy bandwidth, CPU Adam throughput, the efficiency of a real transformer step and the fixed
per-step cost of the DeepSpeed engine (``step_overhead_s``; ``--no-engine-steps`` skips it). The profile
is written only when everything has been measured (atomically: an interrupted run leaves no file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from zeroplan.cli import app
from zeroplan.cli.common import require_runtime

__all__ = ["calibrate"]

_CAL = "Calibrate"


GpusCalOpt = Annotated[
    Optional[int],
    typer.Option("--gpus", help="Processes to measure with [default: this machine's GPUs; without one, 2 ranks on the CPU].", rich_help_panel=_CAL),
]
ProfileOutputOpt = Annotated[
    Optional[Path],
    typer.Option("--output", "-o", help="Write the profile TOML here (atomically) [default: print it].", rich_help_panel="Output"),
]
QuickOpt = Annotated[bool, typer.Option("--quick", help="Small sizes and short timings, engine at stage 2 only (about a minute on 2 shared CPU cores: 57 and 63 s at load 5-8; docs/calibrate.md).", rich_help_panel=_CAL)]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto | cuda | cpu.", rich_help_panel=_CAL)]
WorkloadPrecisionOpt = Annotated[str, typer.Option("--precision", help="bf16 | fp16 | fp32: the dtype of the efficiency workload.", rich_help_panel=_CAL)]
TaskOpt = Annotated[
    Optional[Path],
    typer.Option("--task", help="Measure transformer efficiency on this zeroplan task script instead of the built-in GPT.", rich_help_panel=_CAL),
]
WorkloadMicroBatchOpt = Annotated[int, typer.Option("--micro-batch", help="Samples per step of the efficiency workload.", rich_help_panel=_CAL)]
AdamOpt = Annotated[
    Optional[bool],
    typer.Option("--deepspeed-adam/--torch-adam", help="Time DeepSpeedCPUAdam (builds its op) or torch AdamW [default: DeepSpeed's unless --quick and not built].", rich_help_panel=_CAL),
]
#: ``--engine`` names deepspeed|fsdp on every other command; here the switch is ``--engine-steps``,
#: and its old spelling ``--engine/--no-engine`` is still accepted (hidden).
EngineStepsOpt = Annotated[
    bool,
    typer.Option("--engine-steps/--no-engine-steps", help="Time real DeepSpeed engine steps at two micro-batches for the per-step overhead (step_overhead_s) and the engine's efficiency (old name: --engine/--no-engine).", rich_help_panel=_CAL),
]
EngineStepsAliasOpt = Annotated[Optional[bool], typer.Option("--engine/--no-engine", hidden=True, help="Old name of --engine-steps/--no-engine-steps.")]


def _check_output(output: Optional[Path]) -> None:
    from zeroplan.spec import SpecError

    if output is not None:
        if output.is_dir():
            raise SpecError(f"--output {output} is a directory; give a file path such as profile.toml")
        parent = output.parent if str(output.parent) else Path(".")
        if not parent.is_dir():
            raise SpecError(f"--output {output}: folder {parent} does not exist")


def _table(result, options):
    """The measured figures beside the profile keys they set."""
    from rich.table import Table

    gpu = result.gpu
    table = Table(title=f"{gpu.display_name}: {options.processes} process(es){' (quick)' if options.quick else ''}")
    table.add_column("quantity")
    table.add_column("measured", justify="right")
    table.add_column("profile key")
    for prec in ("bf16", "fp16", "fp32"):
        table.add_row(f"matmul {prec}", f"{gpu.peak_flops[prec] / 1e9:,.1f} GFLOP/s", f"peak_flops.{prec}")
    table.add_row("memory bandwidth (copy)", f"{gpu.memory_bandwidth / 1e9:,.2f} GB/s", "memory_bandwidth")
    table.add_row("collective bus bandwidth", f"{gpu.intra_node_bandwidth / 1e9:,.3f} GB/s", "intra_node_bandwidth")
    table.add_row(
        "inter-node bandwidth", f"guessed: {gpu.inter_node_bandwidth / 1e9:,.3f} GB/s", "inter_node_bandwidth"
    )
    table.add_row("collective latency α", f"{gpu.collective_latency_s * 1e6:,.1f} µs", "collective_latency_s")
    table.add_row("host↔device copy", f"{gpu.host_bandwidth / 1e9:,.2f} GB/s", "host_bandwidth")
    table.add_row("CPU Adam", f"{gpu.cpu_adam_params_per_s / 1e6:,.1f} M params/s", "cpu_adam_params_per_s")
    source = result.calibration.get("efficiency_source", "plain forward + backward")
    table.add_row(f"transformer step ({options.precision}, {source})", f"{gpu.efficiency:.1%} of matmul peak", "efficiency")
    if "engine_overhead_median_s" in result.calibration:
        stages = ", ".join(
            f"z{s} {result.calibration[f'engine_stage{s}_overhead_s'] * 1e3:,.0f}" for s in options.engine_stages
            if f"engine_stage{s}_overhead_s" in result.calibration
        )
        table.add_row(f"engine overhead per step ({stages} ms; median)", f"{gpu.step_overhead_s * 1e3:,.1f} ms", "step_overhead_s")
    else:
        table.add_row("engine overhead per step", str(result.calibration.get("engine", "not measured")), "step_overhead_s")
    return table


@app.command()
def calibrate(
    gpus: GpusCalOpt = None, output: ProfileOutputOpt = None, quick: QuickOpt = False, device: DeviceOpt = "auto",
    precision: WorkloadPrecisionOpt = "bf16", task: TaskOpt = None, micro_batch: WorkloadMicroBatchOpt = 4,
    deepspeed_adam: AdamOpt = None, engine_steps: EngineStepsOpt = True, engine: EngineStepsAliasOpt = None,
) -> None:
    """Measure this machine (matmul, memory, collectives, host copies, CPU Adam) into a GPU profile."""
    import sys

    from rich.console import Console

    require_runtime("calibrate")
    from zeroplan.calibrate import CalibrationError, CalibrationOptions, default_processes
    from zeroplan.calibrate import calibrate as run_calibration
    from zeroplan.cli.common import check_choice_option

    check_choice_option("--device", device, ("auto", "cuda", "cpu"))
    _check_output(output)
    options = CalibrationOptions(
        processes=gpus if gpus is not None else default_processes(device), quick=quick, device=device, precision=precision,
        task=str(task) if task is not None else None, micro_batch=micro_batch, use_deepspeed_adam=deepspeed_adam,
        engine=engine_steps and engine is not False,  # off when either spelling says off
    )
    try:
        result = run_calibration(options, progress=sys.stderr.isatty())
    except CalibrationError as exc:
        print(f"zeroplan: calibration failed: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None

    from zeroplan.profiles import gpu_toml_text, write_gpu_toml

    console = Console(stderr=output is None)
    console.print(_table(result, options))
    console.print(
        "inter-node bandwidth: guessed, not measured (calibrate runs on one node): set to the intra-node figure; "
        "for a multi-node estimate give --node PROFILE (its NICs) or edit inter_node_bandwidth in the written profile"
    )
    if output is None:
        sys.stdout.write(gpu_toml_text(result.gpu, calibration=result.calibration))
    else:
        write_gpu_toml(result.gpu, output, calibration=result.calibration)
        console.print(f"wrote {output}; use it with --gpu {output}")
