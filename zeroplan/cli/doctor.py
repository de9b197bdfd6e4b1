"""``zeroplan doctor LOG...``: why a training run died, and the plan that fixes it.

Exit 0 when the log's failure is recognised (or it holds only measurements), 1 when it is not
(``unknown``), 2 on bad input.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from zeroplan.cli import app
from zeroplan.cli.common import OutputOpt, check_choice_option, resolve_model, stdout_console, write_output
from zeroplan.cli.options import ClusterOptions, ModelOptions, Take, TrainingOptions, grouped
from zeroplan.spec import SpecError

__all__ = ["doctor"]

DoctorGpusOpt = Annotated[
    Optional[int],
    typer.Option("--gpus", help="GPUs the run used [default: the count the config's batch keys imply, else 1].", rich_help_panel="Cluster"),
]
DoctorFormatOpt = Annotated[str, typer.Option("--format", help="table | json.", rich_help_panel="Output")]
ConfigOpt = Annotated[
    Optional[str], typer.Option("--config", help="The DeepSpeed config the run used (JSON): its plan is estimated and kept where it can be.")
]


DoctorCluster = Annotated[ClusterOptions, Take(only=("gpus", "gpu", "gpu_memory", "cpu_memory"), options={"gpus": DoctorGpusOpt})]
DoctorTraining = Annotated[TrainingOptions, Take(only=("seq_len", "micro_batch", "global_batch", "precision", "optimizer"))]
LogsArg = Annotated[list[str], typer.Argument(help="Log file(s), a folder of rank logs, a trainer_state.json, or - for stdin.", show_default=False)]


@app.command()
@grouped
def doctor(
    logs: LogsArg, config: ConfigOpt = None, model_opts: ModelOptions = None, cluster_opts: DoctorCluster = None,
    training_opts: DoctorTraining = None, fmt: DoctorFormatOpt = "table", output: OutputOpt = None,
) -> None:
    """Say why a training run died, from its logs, and which plan fixes it.

    Classes: device-oom (with its phase), host-oom, collective-timeout, collective-mismatch, hang,
    batch-mismatch, auto-value, moe-zero3-desync, stale-jit-lock, version-skew,
    quantized-zero-init, crash, unknown. With --model (and --config) a memory failure gets the
    fastest plan the estimator says fits, as a `zeroplan export` command. Peak memory and
    throughput the run logged (DeepSpeed, torchtitan, torchtune, trainer_state.json) are shown
    beside the estimate.

    Exit code 0 when the failure is recognised, 1 when it is not, 2 on bad input.
    """
    from zeroplan.doctor import DoctorInputs, diagnose, read_logs, read_measurements

    check_choice_option("--format", fmt, ("table", "json"))
    if output is not None and fmt != "json":
        raise SpecError("--output needs --format json (the table prints to the terminal)")
    params, model, gpus = model_opts.params, model_opts.model, cluster_opts.gpus
    gpu, gpu_memory, cpu_memory = cluster_opts.gpu, cluster_opts.gpu_memory, cluster_opts.cpu_memory
    if gpus is not None and gpus < 1:
        raise SpecError(f"--gpus {gpus} is not valid; give at least 1")
    cfg = None
    if config is not None:
        from zeroplan.dsconfig import load_config

        cfg = load_config(config).config
        if not isinstance(cfg, dict):
            raise SpecError(f"--config {config}: a DeepSpeed config is a JSON object")
    training = training_opts.resolve()
    model_spec = None
    model_flags: tuple[str, ...] = ()
    if params is not None or model is not None:
        model_spec = resolve_model(params, model)
        model_flags = ("--model", model) if model is not None else ("--params", f"{params:g}")
    elif any(v is not None for v in (gpu, gpu_memory, cpu_memory)):
        raise SpecError("--gpu/--gpu-memory/--cpu-memory size the fix for a memory failure; also give --model or --params")
    log = read_logs(list(logs))
    inputs = DoctorInputs(model=model_spec, model_flags=model_flags, config=cfg, gpus=gpus, gpu=gpu, gpu_memory_gib=gpu_memory,
                          cpu_memory_gib=cpu_memory, training=training)
    diagnosis = diagnose(log, inputs)
    measurements = read_measurements(log)
    rows = _measured_rows(measurements, inputs) if measurements else []
    only_measured = diagnosis.failure_class == "unknown" and bool(measurements)
    if fmt == "json":
        doc = diagnosis.as_dict()
        doc["sources"] = list(log.sources)
        doc["measured"] = [{"source": m.source, "where": m.where, **{k: v for k, v in vars(m).items() if k not in ("source", "where")},
                            "compared": [{"figure": f, "measured": a, "predicted": b} for f, a, b in r]}
                           for m, r in zip(measurements, rows or [[] for _ in measurements])]
        write_output(json.dumps(doc, indent=2, default=list), output)
    else:
        _render(diagnosis, measurements, rows, only_measured)
    if diagnosis.failure_class == "unknown" and not only_measured:
        raise typer.Exit(1)


def _measured_rows(measurements, inputs) -> list[list[tuple]]:
    """(figure, measured, predicted) per measurement, when a model and config say what ran."""
    if inputs.model is None or inputs.config is None:
        return [[] for _ in measurements]
    from zeroplan.doctor import compare
    from zeroplan.dsconfig.plan import plan_from_config, training_from_config
    from zeroplan.estimator import estimate_plan
    from zeroplan.profiles.resolve import resolve_cluster

    world = inputs.gpus or 1
    plan = plan_from_config(inputs.config, world, micro_batch=inputs.training.micro_batch)
    training = training_from_config(inputs.config, plan, base=inputs.training)
    cluster = resolve_cluster(gpus=world, gpus_per_node=None, gpu=inputs.gpu, gpu_memory_gib=inputs.gpu_memory_gib,
                              cpu_memory_gib=inputs.cpu_memory_gib, nvme_gib=None)
    est = estimate_plan(inputs.model, cluster, training, plan)
    return [compare(m, est, world_size=world, seq_len=training.seq_len) for m in measurements]


def _render(d, measurements, rows, only_measured: bool) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = stdout_console(width=None if sys.stdout.isatty() else 160)
    if not only_measured:
        phase = f" ({d.phase})" if d.phase else ""
        console.print(f"[bold]{d.failure_class}{phase}[/bold]: {escape(d.cause)}")
        if d.evidence:
            console.print(f"  evidence ({escape(d.where or '')}): {escape(d.evidence[:400])}")
        console.print(f"  fix: {escape(d.fix)}")
        if d.export_command:
            console.print(f"  run: {escape(d.export_command)}")
        for note in d.notes:
            console.print(f"[dim]• {escape(note)}[/dim]")
    for m, r in zip(measurements, rows):
        table = Table(title=f"measured by {m.source} ({m.where}) beside the estimate", title_justify="left")
        for col in ("figure", "measured", "predicted"):
            table.add_column(col, justify="left" if col == "figure" else "right")
        if r:
            for figure, measured, predicted in r:
                table.add_row(figure, f"{measured:,.2f}", f"{predicted:,.2f}")
        else:
            for figure, value in (("peak allocated GiB per GPU", m.peak_allocated_gib), ("peak reserved GiB per GPU", m.peak_reserved_gib),
                                  ("tokens/s per GPU", m.tokens_per_second_per_gpu), ("samples/s (all GPUs)", m.samples_per_second)):
                if value is not None:
                    table.add_row(figure, f"{value:,.2f}", "give --model and --config")
        console.print(table)
        for note in m.notes:
            console.print(f"[dim]• {escape(note)}[/dim]")
