"""``zeroplan estimate``: memory, traffic and time for every plan, best first."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from zeroplan.cli import app
from zeroplan.cli.estimate_output import estimates_to_json, estimates_to_rows, summarize
from zeroplan.cli.common import FormatOpt, OutputOpt, check_choice_option, stdout_console, write_output
from zeroplan.cli.options import (
    ClusterOptions, EngineOptions, ModelOptions, PeftGroup, PlanOptions, RecipeOptions, Take, TrainingOptions, grouped,
)
from zeroplan.estimator.gc_pause import gc_paused
from zeroplan.estimator.usecase import (
    EstimateRequest, resolve_checkpointing, run_estimate, with_training_choices,
)
from zeroplan.spec import GiB, SpecError, engine_facts, format_params

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
_MIN_WIDTHS = {"verdict": 10}


#: The table's width when output is piped and COLUMNS is not set.
_PIPED_WIDTH = 170


def _table_console():
    """The terminal's width; :data:`_PIPED_WIDTH` columns when output is piped and COLUMNS is not set."""
    import os

    return stdout_console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else _PIPED_WIDTH)


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
    if not engine_facts(best.engine).runs:
        # export writes DeepSpeed configs and FSDP2 settings; an FSDP1 run keeps its own wrapper.
        return use
    if best.plan.cp > 1:
        # export does not write context-parallel plans (zeroplan.cli.context_option): name the torchtitan setting.
        return f"{use}\nRun it with torchtitan: --parallelism.context_parallel_degree {best.plan.cp} (zeroplan export does not write cp plans)"
    return f"{use}\nWrite it: {export_command(best, options)}"


def _title(model, cluster, training, estimates) -> str:
    """The table's title: the model's counts, the cluster, precision, optimizer, sequence and engine."""
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
    return (
        f"{name}: {counts} on {cluster.gpus}× {cluster.gpu.name} "
        f"({cluster.gpu_memory_bytes / GiB:.0f} GiB, {cluster.nodes} node{'s' if cluster.nodes > 1 else ''}), "
        f"{training.precision}, {training.optimizer}, seq {training.seq_len}"
        + (f", engine {estimates[0].engine}" if estimates and estimates[0].engine != "deepspeed" else "")
    )


def _row(i: int, est: "PlanEstimate", cluster) -> tuple[dict, Optional[str]]:
    """One plan's cells by column, and its style."""
    def g(n: int) -> str:
        return f"{n / GiB:.1f}"

    p = est.plan
    cells = {
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
    }
    return cells, {"fits": None, "tight": "yellow", "oom": "dim"}[est.verdict]


def _build_table(title: str, rows: list, columns: list[str], widths: Optional[dict] = None):
    """The rich table of ``rows`` over ``columns``. With ``widths`` (:func:`~zeroplan.cli.table_fit.column_widths`
    of plain cells that fit) each column is given its width and each cell and header is a ``Text``:
    the same drawing, without rich measuring every cell and reading it as markup."""
    from rich.table import Table

    from zeroplan.cli.table_fit import emoji_free

    if widths is not None:
        from rich.text import Text
    # A title rich would read as markup or emoji stays a string for rich to read (render_annotation styles it "table.title").
    plain_title = widths is not None and "[" not in title and emoji_free(title)
    table = Table(title=Text(title, style="table.title") if plain_title else title, title_justify="left")
    for col in columns:
        # "verdict" may fold its reasons onto a second line; every other cell stays on one.
        table.add_column(
            Text(col) if widths is not None else col, justify="left" if col in _LEFT else "right",
            no_wrap=col != "verdict", min_width=10 if col == "verdict" else None, width=None if widths is None else widths[col],
        )
    for cells, style in rows:
        table.add_row(*(Text(cells[c]) if widths is not None else cells[c] for c in columns), style=style)
    return table


#: The columns whose cells are left-justified (the others are right-justified).
_LEFT = ("offload opt/param", "ckpt", "verdict")


def _fitted_columns(title: str, rows: list, shown, width: int, measure) -> tuple[list[str], list[str], Optional[dict], Any]:
    """The columns shown at ``width``, with the least important left out until the table fits:
    (columns, left out, their widths when every cell is plain text and the table fits, else None;
    the rich table measured last, else None). ``measure`` (a rich table → the width rich draws it)
    is called only for cells that are not plain text."""
    from zeroplan.cli.table_fit import column_widths, plain_cells, widest_table

    # The layout column only when a shown plan is not pure data parallelism (data-parallel tables as before).
    columns = [c for c in _COLUMNS if c != "layout" or any(e.plan.layout_label for e in shown)]
    dropped: list[str] = []
    cells = [cells for cells, _ in rows]
    exact = plain_cells(cells, columns)
    t = None
    for col in _DROP_ORDER:
        if widest_table(cells, columns, min_widths=_MIN_WIDTHS) <= width:
            break  # fits for certain (cli/table_fit.py); plain cells are too wide for certain, else rich measures them
        if not exact:
            t = _build_table(title, rows, columns)
            if measure(t) <= width:
                break
        columns.remove(col)
        dropped.append(col)
        t = None
    if exact and widest_table(cells, columns, min_widths=_MIN_WIDTHS) <= width:
        # Plain cells that fit: rich's widths are the widest cells (cli/table_fit.py).
        return columns, dropped, column_widths(cells, columns, min_widths=_MIN_WIDTHS), None
    return columns, dropped, None, t


def _fitted_table(title: str, rows: list, shown, console):
    """The table with the least important columns left out until it fits the console; (table, left out)."""
    columns, dropped, widths, t = _fitted_columns(
        title, rows, shown, console.width, lambda t: console.measure(t, options=console.options.update(max_width=10_000)).maximum
    )
    if widths is not None:
        return _build_table(title, rows, columns, widths), dropped
    return t or _build_table(title, rows, columns), dropped


def _table_notes(model, cluster, estimates, shown, *, total_plans: int, extra_notes: list[str], dropped: list[str], width: int) -> list[str]:
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
        notes.append(f"left out to fit {width} columns: {', '.join(dropped)} (a wider terminal or --format json shows them)")
    return notes


def _plain_table_text(title: str, rows: list, shown, width: int, notes, recommend: str) -> Optional[str]:
    """What rich prints for the table on a stdout without colour (:mod:`zeroplan.cli.plain_draw`),
    or None when the text is not all shown as typed or the cells do not fit: rich draws it then.
    ``notes`` (left out → the notes) are printed as ``• note``, each wrapped to ``width``."""
    from zeroplan.cli.plain_draw import boxed_table, shown_as_typed, wrapped
    from zeroplan.cli.table_fit import plain_cells

    if not plain_cells([cells for cells, _ in rows], list(_COLUMNS)):
        return None  # rich measures such cells (_fitted_columns' measure)
    columns, dropped, widths, _ = _fitted_columns(title, rows, shown, width, None)
    notes = notes(dropped)
    # Cells are Text (no markup); the title is Text when rich would not read it as markup; the
    # recommendation is printed with soft_wrap (its lines as they are); the notes are wrapped.
    printed = [title, *notes, *(recommend.split("\n") if recommend else ())]
    if any(note.endswith("\\") for note in notes):
        return None  # "[dim]• …\\[/dim]": the backslash escapes the closing tag
    shown_cells = (cells[c] for cells, _ in rows for c in columns)
    if widths is None or not all(map(shown_as_typed, printed)) or not all(shown_as_typed(t, markup=False) for t in shown_cells):
        return None
    lines = [recommend] if recommend else []
    lines += boxed_table(title, columns, widths, (cells for cells, _ in rows), left=_LEFT)
    lines += [line for note in notes for line in wrapped(f"• {note}", width)]
    return "\n".join(lines) + "\n"


def _render_table(
    model, cluster, training, estimates, shown, *, total_plans: int, extra_notes: list[str], console=None, recommend: str = ""
) -> None:
    rows = [_row(i, est, cluster) for i, est in enumerate(shown, 1)]
    title = _title(model, cluster, training, estimates)

    def notes(dropped: list[str], width: int) -> list[str]:
        return _table_notes(model, cluster, estimates, shown, total_plans=total_plans, extra_notes=extra_notes, dropped=dropped, width=width)

    if console is None:
        # Piped without colour: the same characters without rich's console (cli/plain_draw.py).
        from zeroplan.cli.plain_draw import plain_stdout_width

        width = plain_stdout_width(piped=_PIPED_WIDTH)
        try:
            text = None if width is None else _plain_table_text(title, rows, shown, width, lambda dropped: notes(dropped, width), recommend)
        except ImportError:  # plain_draw lays text out with rich._wrap, a private module a rich release may move
            text = None
        if text is not None:
            sys.stdout.write(text)
            sys.stdout.flush()  # as rich does after each print: before anything estimate writes on stderr
            return
        console = _table_console()
    table, dropped = _fitted_table(title, rows, shown, console)
    # Without colours (output piped) rich's highlighter only marks spans nothing draws
    # (Style.render returns the text as is when color_system is None): skip it, same text.
    highlight = False if console.color_system is None else None
    # Text rich's emoji pass would leave as it is skips it (and the loading of its emoji table).
    from zeroplan.cli.table_fit import emoji_free

    if recommend:
        console.print(recommend, soft_wrap=True, highlight=highlight, emoji=False if emoji_free(recommend) else None)
    console.print(table)
    for note in notes(dropped, console.width):
        console.print(f"[dim]• {note}[/dim]", highlight=highlight, emoji=False if emoji_free(note) else None)


NoFlashOpt = Annotated[bool, typer.Option("--no-flash", help="Attention keeps the a·s² score matrix (eager attention).")]
ExpandableOpt = Annotated[bool, typer.Option("--expandable-segments", help="The run sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the CUDA allocator strands no transient segments (docs/estimate.md).")]
TraceOpt = Annotated[bool, typer.Option("--trace", help="With --model config.json: trace activation memory with FakeTensorMode (needs torch, transformers).")]
PlotOpt = Annotated[Optional[Path], typer.Option("--plot", help="Write a stacked bar chart of memory per plan (PNG/SVG/PDF).")]
TopOpt = Annotated[int, typer.Option("--top", help="Rows in the table (0: all configurations).")]
AllPlansOpt = Annotated[bool, typer.Option("--all", help="Table shows every micro-batch, not only the best per configuration.")]
#: estimate takes every engine option but the old ``--backend`` spelling (it never had one).
EstimateEngine = Annotated[EngineOptions, Take(only=("optimizer_impl", "loss", "buckets", "reduce_bucket_size", "allgather_bucket_size",
                                                     "prefetch_bucket_size", "overlap_comm", "engine", "model_save",
                                                     "model_build"))]


def _trace(trace: bool, model_arg: Optional[str], checkpointing: Optional[str], model_spec, cluster, training):
    """``--trace``: (the traced activation override or None, its note or None)."""
    if trace and (model_arg is None or not model_arg.endswith(".json")):
        raise SpecError("--trace needs --model path/to/config.json (a Hugging Face config to trace)")
    if trace and checkpointing == "selective-op":
        # The tracer applies none, attention and full (zeroplan.trace.tracer.TRACED_CHECKPOINTING).
        return None, ("--trace: selective-op is not traced; its activations come from the formula "
                      "(selective_op_layer_bytes: block input, SDPA output and log-sum-exp, every other matmul)")
    if not trace:
        return None, None
    from rich.console import Console

    from zeroplan.estimator import enumerate_plans
    from zeroplan.trace import activation_override

    with Console(stderr=True).status(f"tracing activations of {model_arg} under FakeTensorMode…"):
        traced = activation_override(Path(model_arg), training)
        traced(enumerate_plans(model_spec, cluster, training, stage=0, checkpointing="none")[0])
    # The override counts the loss's backward gradients itself (trace.TracedActivationOverride).
    return traced, traced.describe()


def _json_doc(request, outcome, *, trace_note: Optional[str]) -> dict:
    doc = estimates_to_json(request.model, request.cluster, request.training, outcome.estimates)
    if outcome.layout_note:
        doc["layout_note"] = outcome.layout_note
    if request.recipe is not None:
        doc["recipe"] = request.recipe.as_dict()
    if trace_note and request.activation_bytes is None:
        doc["activation_trace"] = {"note": trace_note, "method": "formula"}
    elif trace_note:
        from zeroplan.estimator import activation_memory

        doc["activation_trace"] = {"note": trace_note, **request.activation_bytes.as_dict()}
        for entry, est in zip(doc["plans"], outcome.estimates):
            entry["activations_formula"] = activation_memory(request.model, request.training, est.plan).total
    return doc


def _recipe_models(recipe) -> dict:
    """The recipe's reference and reward models (:func:`zeroplan.profiles.recipe_models.recipe_models`); {} without a recipe."""
    if recipe is None:
        return {}
    from zeroplan.profiles.recipe_models import recipe_models

    return recipe_models(recipe)


def _export_options(m: ModelOptions, c: ClusterOptions, t: TrainingOptions, peft: PeftGroup, e: EngineOptions, recipe, *,
                    gpus: int, nvme_plan: bool) -> dict:
    """The options the recommended ``zeroplan export`` line repeats (export's names; None left out)."""
    options = dict(
        params=m.params, model=m.model, gpus=gpus, gpus_per_node=c.gpus_per_node, gpu=c.gpu, gpu_memory=c.gpu_memory,
        cpu_memory=c.cpu_memory, node=c.node, nvme=c.nvme, seq_len=t.seq_len, global_batch=t.global_batch, precision=t.precision,
        optimizer=t.optimizer, **{f.name: getattr(peft, f.name) for f in dataclasses.fields(peft)}, optimizer_impl=e.optimizer_impl,
        loss=e.loss, buckets=None if e.buckets == "hf" else e.buckets, reduce_bucket_size=e.reduce_bucket_size,
        allgather_bucket_size=e.allgather_bucket_size, prefetch_bucket_size=e.prefetch_bucket_size,
        engine=None if e.name == "deepspeed" else e.name, model_save=e.model_save, model_build=e.model_build,
    )
    if e.overlap_comm is not None:
        options["overlap_comm"] = e.overlap_comm
    options.update(recipe.as_options() if recipe is not None else {})
    if nvme_plan:
        options["nvme_path"] = "/local_nvme"
    return options


@app.command()
@grouped
def estimate(
    model_opts: ModelOptions, cluster_opts: ClusterOptions, training_opts: TrainingOptions, plan_opts: PlanOptions,
    peft_opts: PeftGroup, engine_opts: EstimateEngine,
    no_flash: NoFlashOpt = False, expandable_segments: ExpandableOpt = False,
    trace: TraceOpt = False, fmt: FormatOpt = "table", output: OutputOpt = None, plot: PlotOpt = None, top: TopOpt = 20,
    all_plans: AllPlansOpt = False, recipe_opts: RecipeOptions = None,
) -> None:
    """Memory per GPU, host memory, traffic and step time for every ZeRO plan, best first.

    Exit code 0 when at least one plan fits, 1 when none does, 2 on bad input.
    """
    check_choice_option("--format", fmt, ("table", "json", "csv"))
    recipe_spec = recipe_opts.resolve()
    gpus = cluster_opts.world(runs_here=False)
    plan_opts.check()
    sp_degrees, tp_degrees = plan_opts.layout()
    plan_buckets = engine_opts.resolve(plan_opts)
    if top < 0:
        raise SpecError(f"--top {top} is not valid; give 0 (all) or a positive count")
    model_spec = model_opts.resolve(peft_opts, precision=training_opts.precision)
    cluster = cluster_opts.resolve(gpus)
    training = with_training_choices(training_opts.resolve(), flash_attention=not no_flash, loss=engine_opts.loss)
    checkpointing, alias_note = resolve_checkpointing(model_spec, training, plan_opts.checkpointing)
    if plot is not None:
        from zeroplan.cli.estimate_plot import check_plot_target

        check_plot_target(plot)  # before anything is printed: a bad --plot is one line, not a table and then an error
    traced, trace_note = _trace(trace, model_opts.model, checkpointing, model_spec, cluster, training)
    request = EstimateRequest(
        model=model_spec, cluster=cluster, training=training, stage=plan_opts.stage, offload_optimizer=plan_opts.offload_optimizer,
        offload_param=plan_opts.offload_param, checkpointing=checkpointing, sp=sp_degrees, tp=tp_degrees, tiled_mlp=plan_opts.tiled_mlp,
        ep=plan_opts.ep, cp=plan_opts.context_degrees(), engine=engine_opts.name, optimizer_impl=engine_opts.optimizer_impl, buckets=plan_buckets,
        expandable_segments=expandable_segments, model_build=engine_opts.model_build, model_save=engine_opts.model_save, activation_bytes=traced, recipe=recipe_spec,
        recipe_models=_recipe_models(recipe_spec),
    )
    with gc_paused():  # the estimates and what is written from them are many small objects (estimator/gc_pause.py)
        outcome = run_estimate(request)
        estimates = outcome.estimates
        if fmt == "json":
            from zeroplan.cli.jsontext import dumps_indented

            write_output(dumps_indented(_json_doc(request, outcome, trace_note=trace_note)), output)
        elif fmt == "csv":
            import pandas as pd

            write_output(pd.DataFrame(estimates_to_rows(estimates)).to_csv(index=False), output)
        else:
            if output is not None:
                raise SpecError("--output needs --format json or csv (the table prints to the terminal)")
            shown = (estimates if all_plans else summarize(estimates))[: top or None]
            options = _export_options(model_opts, cluster_opts, training_opts, peft_opts, engine_opts, recipe_spec, gpus=gpus,
                                      nvme_plan=any("nvme" in (e.plan.offload_param, e.plan.offload_optimizer) for e in estimates[:1]))
            _render_table(model_spec, cluster, training, estimates, shown, total_plans=len(estimates),
                          extra_notes=[n for n in (alias_note, trace_note, outcome.layout_note, recipe_spec and f"recipe {recipe_spec.label}") if n],
                          recommend=recommendation(estimates, options))
    if plot is not None:
        from zeroplan.cli.estimate_plot import plot_plans

        plot_plans(plot, summarize(estimates)[: top or None], cluster)
    if not any(e.fits for e in estimates):
        hint = ", or sequence parallelism: --sp auto" if sp_degrees == (1,) and engine_opts.name == "deepspeed" else ""
        print(f"zeroplan: no plan fits; see the reasons above (more GPUs, offload, checkpointing or a smaller micro-batch{hint})", file=sys.stderr)
        raise typer.Exit(1)
