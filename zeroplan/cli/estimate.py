"""``zeroplan estimate``: memory, traffic and time for every plan, best first."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from zeroplan.cli import app
from zeroplan.cli.estimate_output import estimates_to_json, estimates_to_rows, summarize
from zeroplan.cli.jsontext import dumps_indented
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
    SpOpt,
    StageOpt,
    TiledMlpOpt,
    TpOpt,
    resolve_layout_options,
    check_choice_option,
    check_plan_options,
    resolve_cluster,
    resolve_engine_options,
    resolve_gpus,
    resolve_model,
    resolve_training,
    write_output,
)
from zeroplan.cli.recipe_options import (
    CompletionLenOpt, CriticModelOpt, GenerationsOpt, RecipeOpt, ReferenceOpt, RewardModelOpt, VllmGpuMemoryOpt, VllmSleepOpt, resolve_recipe,
)
from zeroplan.spec import CHECKPOINTING_ALIASES, GiB, SpecError, format_params

from zeroplan.cli.expert_option import EpOpt

if TYPE_CHECKING:
    from zeroplan.estimator import PlanEstimate

__all__ = ["estimate", "estimates_to_json", "estimates_to_rows", "export_command", "recommendation", "summarize"]


def _verdict_cell(est: "PlanEstimate", cluster) -> str:
    """The table's verdict cell: fits/tight with the GPU headroom, or oom with every limit exceeded."""
    if est.verdict == "oom":
        return "oom: " + _short_reason(est, cluster)
    j = est.judgement
    cell = f"{est.verdict} {j.gpu.headroom_pct:.0f}%" if j is not None else est.verdict
    if j is not None and j.host is not None and j.host.verdict == "tight":
        cell += f" (CPU {j.host.headroom_pct:.0f}%)"
    return cell


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
#: traffic figures; the plan, the GPU figure, speed and verdict always stay.
_COLUMNS = (
    "#", "stage", "offload opt/param", "layout", "ckpt", "mb×ga", "params", "grads", "optim", "activ",
    "extra", "GPU", "CPU/node", "comm GB", "step s", "tokens/s", "verdict",
)
_DROP_ORDER = ("params", "grads", "optim", "extra", "activ", "comm GB", "#", "step s", "CPU/node")


def _table_console():
    """The terminal's width; 170 columns when output is piped and COLUMNS is not set."""
    import os

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 170)


def _margin() -> float:
    from zeroplan.estimator.verdict import TIGHT_MARGIN

    return TIGHT_MARGIN


def _number(value: float) -> str:
    """A float as a user types it on the command line: 7e9, 2e12, 0.5 (not 7e+09)."""
    import re

    return re.sub(r"e\+0*", "e", f"{value:g}")


def export_command(est: "PlanEstimate", options: dict, *, output: str = "ds_config.json") -> str:
    """The ``zeroplan export`` command line that writes ``est``'s plan: the estimate's own model,
    cluster and training options (``options``: export's option name → value, None left out) and
    the plan's stage, offloads, checkpointing, micro-batch and accumulation."""
    import shlex

    p = est.plan
    args = ["zeroplan", "export"]
    for name, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [flag, _number(value) if isinstance(value, float) else str(value)]
    args += ["--stage", str(p.stage), "--offload-optimizer", p.offload_optimizer, "--offload-param", p.offload_param,
             "--checkpointing", p.checkpointing, "--micro-batch", str(p.micro_batch)]
    args += [a for name in ("sp", "tp") if getattr(p, name) > 1 for a in (f"--{name}", str(getattr(p, name)))] + (["--tiled-mlp"] if p.tiled_mlp else [])
    if p.ep > 1:
        args += ["--ep", str(p.ep)]
    if "global_batch" not in options or options.get("global_batch") is None:
        args += ["--grad-accum", str(p.gradient_accumulation_steps)]
    args += ["--output", output if est.engine == "deepspeed" else "fsdp_settings.json"]
    return shlex.join(args)


def recommendation(estimates: "list[PlanEstimate]", options: dict) -> str:
    """The line printed above the table: the plan to use, why, and the command that writes it
    (the first of ``estimates``, which :func:`~zeroplan.estimator.estimate_all` ranks by verdict,
    then speed); "" when nothing fits."""
    if not estimates or estimates[0].verdict == "oom":
        return ""
    best = estimates[0]
    j = best.judgement
    room = f"{j.gpu.headroom_bytes / GiB:.1f} GiB ({j.gpu.headroom_pct:.0f} %) GPU headroom" if j is not None else ""
    if j is not None and j.host is not None:
        room += f", {j.host.headroom_pct:.0f} % host RAM headroom"
    if best.verdict == "fits":
        why = f"the fastest plan that fits with at least the {_margin() * 100:.0f} % margin: {room}"
    else:
        why = (f"no plan fits with the {_margin() * 100:.0f} % margin; this is the fastest tight one ({room}): "
               "probe it before a long run")
    use = f"Use {best.plan.label_for(best.engine)}: {why}, {best.tokens_per_second:,.0f} tokens/s predicted."
    if best.engine == "fsdp1":
        # export writes DeepSpeed configs and FSDP2 settings; an FSDP1 run keeps its own wrapper.
        return use
    return f"{use}\nWrite it: {export_command(best, options)}"


def _render_table(
    model, cluster, training, estimates, shown, *, total_plans: int, extra_notes: list[str], console=None, recommend: str = ""
) -> None:
    from rich.table import Table

    from zeroplan.cli.table_fit import widest_table

    console = console or _table_console()
    name = model.name if model.source != "derived" else "model"
    if model.peft is not None:
        counts = (
            f"{format_params(model.total_params)} params ({model.peft.label}: {model.trainable_params / 1e6:.4g}M trainable, "
            f"{format_params(model.frozen_params)} frozen)"
        )
    else:
        counts = f"{format_params(model.params)} params"
    if model.moe is not None:
        # Memory holds every expert; FLOPs and time count what one token touches.
        counts += f", {format_params(model.active_params)} active ({model.moe.experts_per_token} of {model.moe.num_experts} experts)"
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
                "layout": p.layout_label or "dp",
                "ckpt": p.checkpointing + ("+tiledmlp" if p.tiled_mlp else ""),
                "mb×ga": f"{p.micro_batch}×{p.gradient_accumulation_steps}",
                "params": g(est.gpu.params),
                "grads": g(est.gpu.gradients),
                "optim": g(est.gpu.optimizer_states),
                "activ": g(est.gpu.activations),
                # The columns add up to the GPU figure (gpu.required); the cached segments only the
                # reserved peak holds (gpu.total) are in --format json.
                "extra": g(est.gpu.required - est.gpu.params - est.gpu.gradients - est.gpu.optimizer_states - est.gpu.activations),
                "GPU": g(est.gpu.required),
                "CPU/node": g(est.cpu_per_node),
                "comm GB": f"{est.comm_per_step / 1e9:.0f}",
                "step s": f"{est.step_time:.2f}",
                "tokens/s": f"{est.tokens_per_second:,.0f}",
                "verdict": _verdict_cell(est, cluster),
            },
            {"fits": None, "tight": "yellow", "oom": "dim"}[est.verdict],
        ))

    def build(columns: list[str]) -> Table:
        table = Table(title=title, title_justify="left")
        for col in columns:
            # "verdict" may fold its reasons onto a second line; every other cell stays on one.
            table.add_column(
                col, justify="left" if col in ("offload opt/param", "ckpt", "verdict") else "right",
                no_wrap=col != "verdict", min_width=10 if col == "verdict" else None,
            )
        for cells, style in rows:
            table.add_row(*(cells[c] for c in columns), style=style)
        return table

    # Leave out the least important columns until the table fits the terminal.
    # The layout column only when a shown plan is not pure data parallelism (data-parallel tables as before).
    columns = [c for c in _COLUMNS if c != "layout" or any(e.plan.layout_label for e in shown)]
    dropped: list[str] = []
    t = build(columns)
    for col in _DROP_ORDER:
        if widest_table((cells for cells, _ in rows), columns, min_widths={"verdict": 10}) <= console.width:
            break  # fits for certain (cli/table_fit.py); else rich measures it
        if console.measure(t, options=console.options.update(max_width=10_000)).maximum <= console.width:
            break
        columns.remove(col)
        dropped.append(col)
        t = build(columns)
    if recommend:
        console.print(recommend, soft_wrap=True)
    console.print(t)
    notes = list(model.notes) + list(cluster.notes) + extra_notes
    n_fit = sum(e.verdict == "fits" for e in estimates)
    n_tight = sum(e.verdict == "tight" for e in estimates)
    notes.append(
        f"{n_fit} of {total_plans} plans fit, {n_tight} tight (within {_margin() * 100:.0f} % of the GPU's or the node's memory); "
        "showing the best micro-batch per configuration"
        + ("" if len(shown) == len(summarize(estimates)) else f" (top {len(shown)}; --top 0 shows all)")
        + ". Memory in GiB (per GPU, CPU per node); GPU = gpu.required, what the verdict compares (% = headroom); "
        "'extra' = engine buffers + CUDA context + allocator rounding (--format json itemizes, with the reserved peak gpu.total)."
    )
    if dropped:
        notes.append(f"left out to fit {console.width} columns: {', '.join(dropped)} (a wider terminal or --format json shows them)")
    for note in notes:
        console.print(f"[dim]• {note}[/dim]")


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
    sp: SpOpt = None,
    tp: TpOpt = None,
    tiled_mlp: TiledMlpOpt = False,
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
    ep: EpOpt = None,
    engine: Annotated[str, typer.Option("--engine", help="deepspeed (ZeRO as DeepSpeed runs it) | fsdp (PyTorch: DDP for stage 0, ZeroRedundancyOptimizer for 1, FSDP2 fully_shard for 2-3) | fsdp1 (FSDP1 per block, use_orig_params: flat parameters at 2-3).", rich_help_panel="Plan")] = "deepspeed",
    optimizer_impl: OptimizerImplOpt = None,
    model_build: Annotated[Optional[str], typer.Option("--model-build", help="fp32 | bf16 | zero_init | meta | rank0: how each rank builds or loads the model on the host (docs/host-memory.md) [default: rank0 under fsdp, zero_init at DeepSpeed stage 3, else fp32].", rich_help_panel="Plan")] = None,
    trace: Annotated[bool, typer.Option("--trace", help="With --model config.json: trace activation memory with FakeTensorMode (needs torch, transformers).")] = False,
    fmt: FormatOpt = "table",
    output: OutputOpt = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Write a stacked bar chart of memory per plan (PNG/SVG/PDF).")] = None,
    top: Annotated[int, typer.Option("--top", help="Rows in the table (0: all configurations).")] = 20,
    all_plans: Annotated[bool, typer.Option("--all", help="Table shows every micro-batch, not only the best per configuration.")] = False,
    recipe: RecipeOpt = None, generations: GenerationsOpt = None, completion_len: CompletionLenOpt = None,
    vllm_gpu_memory: VllmGpuMemoryOpt = None, vllm_sleep: VllmSleepOpt = False, reference: ReferenceOpt = None,
    reward_model: RewardModelOpt = None, critic_model: CriticModelOpt = None,
) -> None:
    """Memory per GPU, host memory, traffic and step time for every ZeRO plan, best first.

    Exit code 0 when at least one plan fits, 1 when none does, 2 on bad input.
    """
    check_choice_option("--format", fmt, ("table", "json", "csv"))
    recipe_spec = resolve_recipe(recipe, generations=generations, completion_len=completion_len, vllm_gpu_memory=vllm_gpu_memory,
                                 vllm_sleep=vllm_sleep, reference=reference, reward_model=reward_model, critic_model=critic_model)
    gpus = resolve_gpus(gpus, runs_here=False)
    check_plan_options(stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param, checkpointing=checkpointing)
    sp_degrees, tp_degrees = resolve_layout_options(sp, tp)
    plan_buckets = resolve_engine_options(
        engine=engine, optimizer_impl=optimizer_impl, loss=loss, offload_optimizer=offload_optimizer, offload_param=offload_param,
        buckets=buckets, reduce_bucket_size=reduce_bucket_size, allgather_bucket_size=allgather_bucket_size,
        prefetch_bucket_size=prefetch_bucket_size, overlap_comm=overlap_comm,
    )
    if top < 0:
        raise SpecError(f"--top {top} is not valid; give 0 (all) or a positive count")
    from zeroplan.estimator.host import BUILDS

    check_choice_option("--model-build", model_build, BUILDS)
    if model_build == "zero_init" and (engine != "deepspeed" or stage in (0, 1, 2)):
        raise SpecError("--model-build zero_init is DeepSpeed's zero.Init, stage 3 only; give --stage 3 or fp32 | bf16 | meta | rank0")
    from dataclasses import replace

    from zeroplan.estimator import enumerate_plans
    from zeroplan.estimator.plans_recipe import estimate_recipe_all
    from zeroplan.profiles.recipe_models import recipe_models

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
    if plot is not None:
        from zeroplan.cli.estimate_plot import check_plot_target

        check_plot_target(plot)  # before anything is printed: a bad --plot is one line, not a table and then an error
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
    from zeroplan.estimator.expert_parallel import parse_expert_degrees, with_expert_degrees
    from zeroplan.estimator.layout_space import estimate_with_layouts

    estimates, layout_note = estimate_with_layouts(
        model_spec, cluster, training, sp=sp_degrees, tp=tp_degrees,
        plan_options=dict(stage=3 if model_build == "zero_init" else stage, offload_optimizer=offload_optimizer, offload_param=offload_param,
                          checkpointing=checkpointing, engine=engine, optimizer_impl=optimizer_impl, buckets=plan_buckets, tiled_mlp=tiled_mlp),
        estimate_options=dict(activation_bytes=activation_bytes, engine=engine, optimizer_impl=optimizer_impl,
                              expandable_segments=expandable_segments, model_build=model_build),
        estimate_many=None if recipe_spec is None else (
            lambda m, c, t, plans, **kw: estimate_recipe_all(m, c, t, plans, recipe_spec, **kw, **recipe_models(recipe_spec))),
        expand=lambda plans: with_expert_degrees(plans, model_spec, cluster.gpus, parse_expert_degrees(ep, engine=engine)),
    )

    if fmt == "json":
        doc = estimates_to_json(model_spec, cluster, training, estimates)
        if layout_note:
            doc["layout_note"] = layout_note
        if recipe_spec is not None:
            doc["recipe"] = recipe_spec.as_dict()
        if trace_note and traced is None:
            doc["activation_trace"] = {"note": trace_note, "method": "formula"}
        elif trace_note:
            from zeroplan.estimator import activation_memory

            doc["activation_trace"] = {"note": trace_note, **traced.as_dict()}
            for entry, est in zip(doc["plans"], estimates):
                entry["activations_formula"] = activation_memory(model_spec, training, est.plan).total
        write_output(dumps_indented(doc), output)
    elif fmt == "csv":
        import pandas as pd

        write_output(pd.DataFrame(estimates_to_rows(estimates)).to_csv(index=False), output)
    else:
        if output is not None:
            raise SpecError("--output needs --format json or csv (the table prints to the terminal)")
        shown = estimates if all_plans else summarize(estimates)
        if top:
            shown = shown[:top]
        export_options = dict(
            params=params, model=model, gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, gpu_memory=gpu_memory,
            cpu_memory=cpu_memory, node=node, nvme=nvme, seq_len=seq_len, global_batch=global_batch, precision=precision,
            optimizer=optimizer, lora_rank=lora_rank, lora_targets=lora_targets, lora_alpha=lora_alpha, adapter=adapter,
            trainable_params=trainable_params, base_quant=base_quant, optimizer_impl=optimizer_impl, loss=loss,
            buckets=None if buckets == "hf" else buckets, reduce_bucket_size=reduce_bucket_size,
            allgather_bucket_size=allgather_bucket_size, prefetch_bucket_size=prefetch_bucket_size,
            engine=None if engine == "deepspeed" else engine,
        )
        if overlap_comm is not None:
            export_options["overlap_comm"] = overlap_comm
        export_options.update(recipe_spec.as_options() if recipe_spec is not None else {})
        if any(e.plan.offload_param == "nvme" or e.plan.offload_optimizer == "nvme" for e in estimates[:1]):
            export_options["nvme_path"] = "/local_nvme"
        _render_table(model_spec, cluster, training, estimates, shown, total_plans=len(estimates),
                      extra_notes=[n for n in (alias_note, trace_note, layout_note, recipe_spec and f"recipe {recipe_spec.label}") if n],
                      recommend=recommendation(estimates, export_options))
    if plot is not None:
        from zeroplan.cli.estimate_plot import plot_plans

        plot_plans(plot, summarize(estimates)[: top or None], cluster)
    if not any(e.fits for e in estimates):
        hint = ", or sequence parallelism: --sp auto" if sp_degrees == (1,) and engine == "deepspeed" else ""
        print(f"zeroplan: no plan fits; see the reasons above (more GPUs, offload, checkpointing or a smaller micro-batch{hint})", file=sys.stderr)
        raise typer.Exit(1)
