"""``zeroplan estimate``: memory, traffic and time for every plan, best first."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from zeroplan import __version__
from zeroplan.cli import app
from zeroplan.cli.common import (
    AdapterOpt,
    AllgatherBucketOpt,
    BaseQuantOpt,
    BucketsOpt,
    LossOpt,
    OptimizerImplOpt,
    PrefetchBucketOpt,
    OverlapCommOpt,
    ReduceBucketOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    TrainableParamsOpt,
    CheckpointingOpt,
    CpuMemoryOpt,
    FormatOpt,
    GlobalBatchOpt,
    GpuMemoryOpt,
    GpuOpt,
    GpusOpt,
    GpusPerNodeOpt,
    GradAccumOpt,
    MicroBatchOpt,
    ModelOpt,
    NodeOpt,
    NvmeOpt,
    OffloadOptimizerOpt,
    OffloadParamOpt,
    OptimizerOpt,
    OutputOpt,
    ParamsOpt,
    PeftOptions,
    PrecisionOpt,
    SeqLenOpt,
    StageOpt,
    check_choice_option,
    check_plan_options,
    resolve_cluster,
    resolve_engine_options,
    resolve_gpus,
    resolve_model,
    resolve_training,
    write_output,
)
from zeroplan.spec import CHECKPOINTING_ALIASES, GiB, SpecError, format_params

if TYPE_CHECKING:
    from zeroplan.estimator import PlanEstimate

__all__ = ["estimate", "estimates_to_json", "estimates_to_rows", "summarize"]


def summarize(estimates: "list[PlanEstimate]") -> "list[PlanEstimate]":
    """Best micro-batch per (stage, offloads, checkpointing), kept in ranking order."""
    seen: set[tuple] = set()
    best = []
    for est in estimates:
        p = est.plan
        key = (p.stage, p.offload_optimizer, p.offload_param, p.checkpointing)
        if key in seen:
            continue
        seen.add(key)
        best.append(est)
    return best


def estimates_to_rows(estimates: "list[PlanEstimate]") -> list[dict]:
    """Flat rows (one per plan) for CSV: bytes as integers, times in seconds."""
    rows = []
    for est in estimates:
        d = est.plan.as_dict()
        for k, v in est.gpu.as_dict().items():
            d[f"gpu_{k}"] = v
        d.update(
            cpu_per_node=est.cpu_per_node,
            nvme_per_node=est.nvme_per_node,
            comm_per_step=est.comm_per_step,
            pcie_per_step=est.comm.pcie,
            step_time=est.step_time,
            tokens_per_second=est.tokens_per_second,
            fits=est.fits,
            notes="; ".join(est.notes),
        )
        rows.append(d)
    return rows


def estimates_to_json(model, cluster, training, estimates: "list[PlanEstimate]") -> dict:
    """The ``estimate --format json`` document of docs/design.md."""
    return {
        "zeroplan_version": __version__,
        "model": model.as_dict(),
        "cluster": cluster.as_dict(),
        "training": training.as_dict(),
        "plans": [e.as_dict() for e in estimates],
    }


def _short_reason(est: "PlanEstimate", cluster) -> str:
    """One short cell for the table naming every limit the plan exceeds (the sentences are in ``notes``)."""
    reasons = []
    if est.gpu.required > cluster.gpu_memory_bytes:
        reasons.append(f"GPU {est.gpu.required / GiB:.1f}>{cluster.gpu_memory_bytes / GiB:.0f}")
    if cluster.cpu_memory_per_node_bytes and est.cpu_per_node > cluster.cpu_memory_per_node_bytes:
        reasons.append(f"CPU {est.cpu_per_node / GiB:.0f}>{cluster.cpu_memory_per_node_bytes / GiB:.0f}")
    if est.nvme_per_node and not cluster.nvme_per_node_bytes:
        reasons.append("needs --nvme")
    elif est.nvme_per_node > cluster.nvme_per_node_bytes:
        reasons.append(f"NVMe {est.nvme_per_node / GiB:.0f}>{cluster.nvme_per_node_bytes / GiB:.0f}")
    return " ".join(reasons)


#: The table's columns, and the order in which they are left out when the terminal is narrower
#: than the table: first the per-state breakdown (``--format json`` itemizes it), then host and
#: traffic figures; the plan, GPU total, speed and fit always stay.
_COLUMNS = (
    "#", "stage", "offload opt/param", "ckpt", "mb×ga", "params", "grads", "optim", "activ",
    "extra", "GPU", "CPU/node", "comm GB", "step s", "tokens/s", "fits",
)
_DROP_ORDER = ("params", "grads", "optim", "extra", "activ", "comm GB", "#", "step s", "CPU/node")


def _table_console():
    """The terminal's width; 170 columns when output is piped and COLUMNS is not set."""
    import os

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 170)


def _render_table(
    model, cluster, training, estimates, shown, *, total_plans: int, extra_notes: list[str], console=None
) -> None:
    from rich.table import Table

    console = console or _table_console()
    name = model.name if model.source != "derived" else "model"
    if model.peft is not None:
        counts = (
            f"{format_params(model.total_params)} params ({model.peft.label}: {model.trainable_params / 1e6:.4g}M trainable, "
            f"{format_params(model.frozen_params)} frozen)"
        )
    else:
        counts = f"{format_params(model.params)} params"
    title = (
        f"{name}: {counts} on {cluster.gpus}× {cluster.gpu.name} "
        f"({cluster.gpu_memory_bytes / GiB:.0f} GiB, {cluster.nodes} node{'s' if cluster.nodes > 1 else ''}), "
        f"{training.precision}, {training.optimizer}, seq {training.seq_len}"
        + (f", engine {estimates[0].engine}" if estimates and estimates[0].engine != "deepspeed" else "")
    )

    def g(n: int) -> str:
        return f"{n / GiB:.1f}"

    rows = []
    for i, est in enumerate(shown, 1):
        p = est.plan
        rows.append((
            {
                "#": str(i),
                "stage": p.stage_name(est.engine),
                "offload opt/param": f"{p.offload_optimizer}/{p.offload_param}",
                "ckpt": p.checkpointing,
                "mb×ga": f"{p.micro_batch}×{p.gradient_accumulation_steps}",
                "params": g(est.gpu.params),
                "grads": g(est.gpu.gradients),
                "optim": g(est.gpu.optimizer_states),
                "activ": g(est.gpu.activations),
                "extra": g(est.gpu.overhead),
                "GPU": g(est.gpu.total),
                "CPU/node": g(est.cpu_per_node),
                "comm GB": f"{est.comm_per_step / 1e9:.0f}",
                "step s": f"{est.step_time:.2f}",
                "tokens/s": f"{est.tokens_per_second:,.0f}",
                "fits": "yes" if est.fits else "no: " + _short_reason(est, cluster),
            },
            None if est.fits else "dim",
        ))

    def build(columns: list[str]) -> Table:
        table = Table(title=title, title_justify="left")
        for col in columns:
            # "fits" may fold its reasons onto a second line; every other cell stays on one.
            table.add_column(
                col, justify="left" if col in ("offload opt/param", "ckpt", "fits") else "right",
                no_wrap=col != "fits", min_width=10 if col == "fits" else None,
            )
        for cells, style in rows:
            table.add_row(*(cells[c] for c in columns), style=style)
        return table

    # Leave out the least important columns until the table fits the terminal.
    columns = list(_COLUMNS)
    dropped: list[str] = []
    t = build(columns)
    for col in _DROP_ORDER:
        if console.measure(t, options=console.options.update(max_width=10_000)).maximum <= console.width:
            break
        columns.remove(col)
        dropped.append(col)
        t = build(columns)
    console.print(t)
    notes = list(model.notes) + list(cluster.notes) + extra_notes
    n_fit = sum(e.fits for e in estimates)
    notes.append(
        f"{n_fit} of {total_plans} plans fit; showing the best micro-batch per configuration"
        + ("" if len(shown) == len(summarize(estimates)) else f" (top {len(shown)}; --top 0 shows all)")
        + ". Memory in GiB (per GPU, CPU per node); 'extra' = engine buffers + CUDA reserve (--format json itemizes)."
    )
    if dropped:
        notes.append(f"left out to fit {console.width} columns: {', '.join(dropped)} (a wider terminal or --format json shows them)")
    for note in notes:
        console.print(f"[dim]• {note}[/dim]")


def _plot(path: Path, estimates, cluster) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecError("--plot needs matplotlib; install it with: pip install 'zeroplan[plot]'") from None
    if path.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise SpecError(f"--plot {path}: give a .png, .svg or .pdf file name")
    labels = [e.plan.label_for(e.engine) for e in estimates]
    parts = ("params", "gradients", "optimizer_states", "activations", "overhead")
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(labels) + 2), 5))
    bottoms = [0.0] * len(estimates)
    for part in parts:
        vals = [getattr(e.gpu, part) / GiB for e in estimates]
        ax.bar(labels, vals, bottom=bottoms, label=part.replace("_", " "))
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.axhline(cluster.gpu_memory_bytes / GiB, color="black", linestyle="--", label=f"{cluster.gpu.name} capacity")
    ax.set_ylabel("GiB per GPU")
    ax.set_title("Memory per GPU by plan")
    ax.tick_params(axis="x", labelrotation=70, labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        fig.savefig(tmp)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SpecError(f"--plot {path}: cannot write ({exc.strerror})") from None
    finally:
        plt.close(fig)


@app.command()
def estimate(
    params: ParamsOpt = None,
    model: ModelOpt = None,
    gpus: GpusOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    cpu_memory: CpuMemoryOpt = None,
    node: NodeOpt = None,
    nvme: NvmeOpt = None,
    seq_len: SeqLenOpt = 2048,
    micro_batch: MicroBatchOpt = None,
    global_batch: GlobalBatchOpt = None,
    grad_accum: GradAccumOpt = None,
    precision: PrecisionOpt = "bf16",
    optimizer: OptimizerOpt = "adamw",
    stage: StageOpt = None,
    offload_optimizer: OffloadOptimizerOpt = None,
    offload_param: OffloadParamOpt = None,
    checkpointing: CheckpointingOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    adapter: AdapterOpt = None,
    trainable_params: TrainableParamsOpt = None,
    base_quant: BaseQuantOpt = None,
    no_flash: Annotated[bool, typer.Option("--no-flash", help="Attention keeps the a·s² score matrix (eager attention).")] = False,
    expandable_segments: Annotated[bool, typer.Option("--expandable-segments", help="The run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the CUDA allocator strands no transient segments (docs/estimate.md).")] = False,
    loss: LossOpt = None,
    buckets: BucketsOpt = "hf",
    reduce_bucket_size: ReduceBucketOpt = None,
    allgather_bucket_size: AllgatherBucketOpt = None,
    prefetch_bucket_size: PrefetchBucketOpt = None,
    overlap_comm: OverlapCommOpt = None,
    engine: Annotated[str, typer.Option("--engine", help="deepspeed (ZeRO as DeepSpeed runs it) | fsdp (PyTorch: DDP for stage 0, ZeroRedundancyOptimizer for 1, FSDP2 fully_shard for 2-3).", rich_help_panel="Plan")] = "deepspeed",
    optimizer_impl: OptimizerImplOpt = None,
    trace: Annotated[bool, typer.Option("--trace", help="With --model config.json: trace activation memory with FakeTensorMode (needs torch, transformers).")] = False,
    fmt: FormatOpt = "table",
    output: OutputOpt = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a stacked bar chart of memory per plan (PNG/SVG/PDF).")] = None,
    top: Annotated[int, typer.Option("--top", help="Rows in the table (0: all configurations).")] = 20,
    all_plans: Annotated[bool, typer.Option("--all", help="Table shows every micro-batch, not only the best per configuration.")] = False,
) -> None:
    """Memory per GPU, host memory, traffic and step time for every ZeRO plan, best first.

    Exit code 0 when at least one plan fits, 1 when none does, 2 on bad input.
    """
    check_choice_option("--format", fmt, ("table", "json", "csv"))
    gpus = resolve_gpus(gpus, runs_here=False)
    check_plan_options(stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param, checkpointing=checkpointing)
    plan_buckets = resolve_engine_options(
        engine=engine, optimizer_impl=optimizer_impl, loss=loss, offload_optimizer=offload_optimizer, offload_param=offload_param,
        buckets=buckets, reduce_bucket_size=reduce_bucket_size, allgather_bucket_size=allgather_bucket_size,
        prefetch_bucket_size=prefetch_bucket_size, overlap_comm=overlap_comm,
    )
    if top < 0:
        raise SpecError(f"--top {top} is not valid; give 0 (all) or a positive count")
    from dataclasses import replace

    from zeroplan.estimator import enumerate_plans, estimate_all

    model_spec = PeftOptions(lora_rank, lora_targets, lora_alpha, adapter, trainable_params, base_quant).apply(
        resolve_model(params, model), model, precision=precision
    )
    cluster = resolve_cluster(
        gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, gpu_memory_gib=gpu_memory, cpu_memory_gib=cpu_memory, nvme_gib=nvme, node=node
    )
    training = resolve_training(
        precision=precision, optimizer=optimizer, seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch, grad_accum=grad_accum
    )
    if no_flash:
        training = replace(training, flash_attention=False)
    training = replace(training, loss=loss or "hf")
    alias_note = None
    if checkpointing in CHECKPOINTING_ALIASES:
        alias_note = f"--checkpointing {checkpointing} is now called {CHECKPOINTING_ALIASES[checkpointing]} (Korthikanti's attention-core recomputation)"
        checkpointing = CHECKPOINTING_ALIASES[checkpointing]
    if checkpointing is not None:
        from zeroplan.estimator import checkpointing_duplicate

        duplicate = checkpointing_duplicate(model_spec, training, checkpointing)
        alias_note = "; ".join(n for n in (alias_note, duplicate) if n) or None
    activation_bytes = None
    trace_note = None
    traced = None
    if trace and (model is None or not model.endswith(".json")):
        raise SpecError("--trace needs --model path/to/config.json (a Hugging Face config to trace)")
    if trace and checkpointing == "selective-op":
        # The tracer applies none, attention and full (zeroplan.trace.tracer.TRACED_CHECKPOINTING).
        trace_note = ("--trace: selective-op is not traced; its activations come from the formula "
                      "(selective_op_layer_bytes: block input, SDPA output and log-sum-exp, every other matmul)")
        trace = False
    if trace:
        from rich.console import Console

        from zeroplan.trace import activation_override

        with Console(stderr=True).status(f"tracing activations of {model} under FakeTensorMode…"):
            traced = activation_override(Path(model), training)
            traced(enumerate_plans(model_spec, cluster, training, stage=0, checkpointing="none")[0])
        # The override counts the loss's backward gradients itself (trace.TracedActivationOverride).
        activation_bytes = traced
        trace_note = traced.describe()
    plans = enumerate_plans(
        model_spec, cluster, training,
        stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param, checkpointing=checkpointing, engine=engine,
        optimizer_impl=optimizer_impl, buckets=plan_buckets,
    )
    estimates = estimate_all(
        model_spec, cluster, training, plans, activation_bytes=activation_bytes, engine=engine, optimizer_impl=optimizer_impl,
        expandable_segments=expandable_segments,
    )

    if fmt == "json":
        doc = estimates_to_json(model_spec, cluster, training, estimates)
        if trace_note and traced is None:
            doc["activation_trace"] = {"note": trace_note, "method": "formula"}
        elif trace_note:
            from zeroplan.estimator import activation_memory

            doc["activation_trace"] = {"note": trace_note, **traced.as_dict()}
            for entry, est in zip(doc["plans"], estimates):
                entry["activations_formula"] = activation_memory(model_spec, training, est.plan).total
        write_output(json.dumps(doc, indent=2, default=str), output)
    elif fmt == "csv":
        import pandas as pd

        write_output(pd.DataFrame(estimates_to_rows(estimates)).to_csv(index=False), output)
    else:
        if output is not None:
            raise SpecError("--output needs --format json or csv (the table prints to the terminal)")
        shown = estimates if all_plans else summarize(estimates)
        if top:
            shown = shown[:top]
        _render_table(model_spec, cluster, training, estimates, shown, total_plans=len(estimates), extra_notes=[n for n in (alias_note, trace_note) if n])
    if plot is not None:
        _plot(plot, summarize(estimates)[: top or None], cluster)
    if not any(e.fits for e in estimates):
        print("zeroplan: no plan fits; see the reasons above (more GPUs, offload, checkpointing or a smaller micro-batch)", file=sys.stderr)
        raise typer.Exit(1)
