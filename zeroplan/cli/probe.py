"""``zeroplan probe SCRIPT``: run one short probe job and print measured vs estimated.

    zeroplan probe examples/train_deepspeed.py --config ds.json --gpus 2
    zeroplan probe examples/gpt_task.py --stage 3 --micro-batch 2 --gpus 2 --engine fsdp
    zeroplan probe train.py --config ds.json --config-arg --deepspeed -- --model_name gpt2

Exit 0 when the probe ran its steps, 1 when it failed (oom, error, timeout), 2 on bad input.
"""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from zeroplan.cli import app
from zeroplan.cli.common import (
    OutputOpt, RunGpusOpt, check_choice_option, require_runtime, resolve_model, resolve_training, stdout_console, terminal_width,
    write_output,
)
from zeroplan.cli.options import (
    ClusterOptions, EngineOptions, ModelOptions, PeftGroup, PlanOptions, RecipeOptions, Take, TrainingOptions, grouped,
)
from zeroplan.cli.nodes import LauncherOpt, local_launcher, NnodesOpt, NodeRankOpt, RdzvEndpointOpt, RdzvTimeoutOpt, resolve_nodes
from zeroplan.spec import RUNNABLE_ENGINES, GiB, SpecError

__all__ = ["probe"]

_PROBE = "Probe"
ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", help="DeepSpeed JSON config (default for a zeroplan task: built from the plan flags).", rich_help_panel=_PROBE),
]
ProbeFormatOpt = Annotated[str, typer.Option("--format", help="table | json.", rich_help_panel="Output")]
StepsOpt = Annotated[int, typer.Option("--steps", help="Measured optimizer steps.", rich_help_panel=_PROBE)]
WarmupOpt = Annotated[int, typer.Option("--warmup", help="Optimizer steps run before measuring.", rich_help_panel=_PROBE)]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="Seconds before the whole job is killed.", rich_help_panel=_PROBE)]
ConfigArgOpt = Annotated[
    str, typer.Option("--config-arg", help="How the script takes its config path (--deepspeed for HF Trainer).", rich_help_panel=_PROBE)
]
WorkdirOpt = Annotated[
    Optional[Path], typer.Option("--workdir", help="Folder for config, per-rank results and the full log [default: a temp folder].", rich_help_panel=_PROBE)
]
TorchrunArgOpt = Annotated[
    Optional[list[str]],
    typer.Option("--torchrun-arg", help="Extra torchrun argument, repeatable (e.g. --torchrun-arg=--nnodes=2).", rich_help_panel=_PROBE),
]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Stream the job's log to stderr.", rich_help_panel=_PROBE)]
SpProbeOpt = Annotated[int, typer.Option("--sp", help="Ulysses sequence-parallel degree (DeepSpeed sequence_parallel_size; HF models).", rich_help_panel=_PROBE)]
TpProbeOpt = Annotated[int, typer.Option("--tp", help="AutoTP tensor-parallel degree (DeepSpeed tensor_parallel.autotp_size).", rich_help_panel=_PROBE)]
SeqLenProbeOpt = Annotated[
    Optional[int], typer.Option("--seq-len", help="Tokens per sample (for tokens/s and the estimate) [default: the task's].", rich_help_panel="Training")
]


def _mib(n: Optional[int]) -> str:
    return "—" if n is None else f"{n / 2**20:,.1f} MiB" if n < GiB else f"{n / GiB:,.2f} GiB"


def _render_table(result, plan, console) -> None:
    from rich.table import Table

    from zeroplan.runtime.measure.recipe_estimate import plan_as_trained

    plan = plan_as_trained(result.trl, plan)  # a Trainer's gradient_checkpointing, which the config does not carry

    title = f"probe: {result.status}  ({result.backend}, {result.world_size} ranks" + (f", plan {plan.label_for(result.backend)}" if plan else "") + ")"
    table = Table(title=title, title_justify="left")
    table.add_column("quantity")
    table.add_column("measured", justify="right")
    table.add_column("estimated", justify="right")
    table.add_column("error", justify="right")
    err = result.memory_error
    table.add_row("peak memory / rank (max)", _mib(result.peak_memory), _mib(result.estimated_peak_memory), "—" if err is None else f"{err:+.1%}")
    nodes = result.node_per_rank
    for rank, peak in enumerate(result.peak_memory_per_rank):
        where = f" (node {nodes[rank]})" if rank < len(nodes) and nodes[rank] is not None else ""
        table.add_row(f"  rank {rank}{where}", _mib(peak), "", "")
    if result.host_peak_per_node is not None:
        herr = result.host_memory_error
        table.add_row("host RSS / node (peak)", _mib(result.host_peak_per_node), _mib(result.estimated_host_peak_per_node),
                      "—" if herr is None else f"{herr:+.1%}")
        estimated = result.estimated_host_phases_per_node
        for phase, measured in result.host_phase_peaks_per_node.items():
            mark = " (worst)" if phase == result.host_worst_phase else ""
            table.add_row(f"  {phase.replace('_', ' ')}{mark}", _mib(measured), _mib(estimated.get(phase)), "")
    if result.memory_limit:
        table.add_row("ran out of", f"{result.memory_limit} memory", "", "")
    table.add_row("measured steps", str(result.steps), "", "")
    table.add_row("step time (slowest rank)" if nodes else "step time", "—" if result.step_time is None else f"{result.step_time:.4f} s", "", "")
    if nodes:
        for rank, t in enumerate(result.step_time_per_rank):
            where = f" (node {nodes[rank]})" if rank < len(nodes) and nodes[rank] is not None else ""
            table.add_row(f"  rank {rank}{where}", "—" if t is None else f"{t:.4f} s", "", "")
    table.add_row("samples / s", "—" if result.samples_per_second is None else f"{result.samples_per_second:,.1f}", "", "")
    table.add_row("tokens / s", "—" if result.tokens_per_second is None else f"{result.tokens_per_second:,.0f}", "", "")
    console.print(table)
    if result.discovered_model:
        from zeroplan.runtime.discovery.discover import DiscoveredModel

        console.print(f"model {DiscoveredModel.from_dict(result.discovered_model).describe()}", markup=False, highlight=False)
    if result.recipe:
        from zeroplan.runtime.discovery.recipe_discovery import recipe_lines

        phases = result.memory_phases_per_rank[0] if result.memory_phases_per_rank else None
        for line in recipe_lines(result.trainer, result.recipe, result.frozen_engines, phases):
            console.print(line, markup=False, highlight=False)
    if result.activations_source:
        from zeroplan.runtime.discovery.discover import ACTIVATION_SOURCE_WORDS

        console.print(f"activations: {ACTIVATION_SOURCE_WORDS.get(result.activations_source, result.activations_source)}",
                      markup=False, highlight=False)
    if result.estimate_note and result.status == "ok":
        console.print(result.estimate_note)
    if result.memory_kind == "cpu-storage":
        console.print("memory: live tensor storage bytes per rank (CPU run; compared with the estimator's device=cpu figure)")
    if result.error:
        console.print(f"[bold red]{result.status}[/]: {result.error}")
        if result.log_tail:
            console.print("last log lines:")
            console.print("\n".join(result.log_tail.splitlines()[-15:]), markup=False, highlight=False)
    console.print(f"workdir: {result.workdir}")


#: probe's engine options: ``--engine`` (its old name ``--backend`` hidden) under the Probe panel; not
#: ``--model-save`` or ``--model-build`` (a probe runs the script's own build and save and measures them).
ProbeEngine = Annotated[EngineOptions, Take(only=("optimizer_impl", "loss", "buckets", "reduce_bucket_size", "allgather_bucket_size",
                                                  "prefetch_bucket_size", "overlap_comm", "engine", "backend"),
                                            options={"engine": Annotated[str, typer.Option(
    "--engine", help="deepspeed | fsdp (fsdp runs zeroplan tasks only); as in estimate and export (old name: --backend).", rich_help_panel=_PROBE)]})]
ProbeCluster = Annotated[ClusterOptions, Take(only=("gpus", "gpus_per_node"), options={"gpus": RunGpusOpt})]
ProbeTraining = Annotated[TrainingOptions, Take(only=("seq_len", "micro_batch", "grad_accum", "precision", "optimizer"),
                                                options={"seq_len": SeqLenProbeOpt}, defaults={"seq_len": None})]
ProbePlan = Annotated[PlanOptions, Take(only=("stage", "offload_optimizer", "offload_param", "checkpointing"))]


def _model(model_opts, peft_opts, precision: str):
    """(the model with its fine-tuning layout or None, the PEFT flags for the runtime or None).

    What needs no model is checked now; a layout that does not fit the model is an error now
    with --model/--params, and a note beside the measurement for a task's or discovered model."""
    from zeroplan.runtime.measure.peft_source import PeftFlags

    peft_flags = PeftFlags(**{f.name: getattr(peft_opts, f.name) for f in dataclasses.fields(peft_opts)},
                           model_arg=model_opts.model, precision=precision)
    model_spec = resolve_model(model_opts.params, model_opts.model) if model_opts.given else None
    if model_spec is not None and peft_flags.given:
        model_spec = peft_flags.for_model(model_spec)
    return model_spec, (peft_flags if peft_flags.given else None)


def _run(request, *, verbose: bool):
    from rich.console import Console

    from zeroplan.runtime import run_probe
    from zeroplan.runtime.rank.dsops import lock_report

    for note in lock_report():  # probes build in their own folder; the user's own runs would wait on these
        print(f"zeroplan: note: {note}", file=sys.stderr)
    if verbose:
        return run_probe(request, on_line=lambda line: print(line, file=sys.stderr))
    name, backend = request.script.name, request.backend
    with Console(stderr=True).status(f"probing {name} on {request.nproc} processes ({backend}) ...") as status:
        def show(line: str) -> None:
            status.update(f"probing {name} ({backend}): {line[:100]}")

        return run_probe(request, on_line=show)


def _report(result, plan, *, fmt: str, output) -> None:
    from rich.console import Console

    if fmt == "json":
        write_output(json.dumps(result.as_dict(), indent=2), output)
    elif output is None:
        # A stdout its reader closed ends the command quietly (exit 141: zeroplan.cli.main).
        _render_table(result, plan, stdout_console(width=terminal_width(120)))
    else:
        console = Console(file=io.StringIO(), width=120)
        _render_table(result, plan, console)
        write_output(console.file.getvalue(), output)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@grouped
def probe(
    ctx: typer.Context,
    script: Annotated[Path, typer.Argument(help="DeepSpeed training script, or a zeroplan task (defines zeroplan_task()).")],
    config: ConfigOpt = None, cluster_opts: ProbeCluster = None, model_opts: ModelOptions = None, steps: StepsOpt = 5,
    warmup: WarmupOpt = 2, timeout: TimeoutOpt = 300.0, config_arg: ConfigArgOpt = "--deepspeed_config", workdir: WorkdirOpt = None,
    torchrun_arg: TorchrunArgOpt = None, training_opts: ProbeTraining = None, plan_opts: ProbePlan = None,
    engine_opts: ProbeEngine = None, recipe_opts: RecipeOptions = None, peft_opts: PeftGroup = None, fmt: ProbeFormatOpt = "table",
    output: OutputOpt = None, verbose: VerboseOpt = False, nnodes: NnodesOpt = 1, launcher: LauncherOpt = None,
    node_rank: NodeRankOpt = None, rdzv_endpoint: RdzvEndpointOpt = None, rdzv_timeout: RdzvTimeoutOpt = 120.0,
    sp: SpProbeOpt = 1, tp: TpProbeOpt = 1,
) -> None:
    """Run SCRIPT for a few optimizer steps (ranks forked from a warm process, or torchrun) and print measured vs estimated.

    Script arguments go after `--`. The LoRA options (--lora-rank, --adapter, ...) set the layout
    the estimate uses when the run's own model does not carry one; the trainable count the
    engine reports (requires_grad) comes first. Without CUDA the job runs on CPU over gloo (DS_ACCELERATOR=cpu) and peak memory is live tensor storage per rank.
    """
    from zeroplan.runtime import ProbeRequest, script_kind
    from zeroplan.runtime.probe_setup import ProbeChoices, probe_setup

    check_choice_option("--format", fmt, ("table", "json"))
    backend = engine_opts.name
    check_choice_option(engine_opts.flag, backend, RUNNABLE_ENGINES)
    require_runtime("probe")
    gpus = cluster_opts.world(runs_here=True)
    plan_opts.check()
    plan_buckets = engine_opts.resolve(plan_opts)
    if config is not None and engine_opts.bucket_flags_given:
        raise SpecError("bucket sizes come from --config; drop --buckets and --*-bucket-size (they size the config built from --stage)")
    if config is not None and engine_opts.overlap_comm is not None:
        raise SpecError("overlap_comm comes from --config (zero_optimization.overlap_comm); drop --overlap-comm (it sets the config built from --stage)")
    torchrun_args = tuple(torchrun_arg or ())
    nproc, nodes = resolve_nodes(gpus=gpus, gpus_per_node=cluster_opts.gpus_per_node, nnodes=nnodes, launcher=launcher,
                                 node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_timeout=rdzv_timeout, legacy_torchrun_args=torchrun_args)
    if workdir is not None and workdir.exists() and not workdir.is_dir():
        raise SpecError(f"--workdir {workdir} is a file; give a folder (created if missing)")
    if nodes is not None and workdir is None:
        raise SpecError("a multi-node probe needs --workdir DIR: a folder every node sees at the same path (a shared file system)")
    if nodes is not None:
        nodes.kind.preflight(nodes)  # outside a Slurm allocation / too few nodes: before anything is written
    if not script.is_file():
        raise SpecError(f"script {script} does not exist or is not a file")
    model_spec, peft_flags = _model(model_opts, peft_opts, training_opts.precision)
    seq_len = training_opts.seq_len
    setup = probe_setup(ProbeChoices(
        gpus=gpus, engine=backend, engine_flag=engine_opts.flag, config=config, stage=plan_opts.stage,
        offload_optimizer=plan_opts.offload_optimizer, offload_param=plan_opts.offload_param, checkpointing=plan_opts.checkpointing,
        micro_batch=training_opts.micro_batch, grad_accum=training_opts.grad_accum, buckets=plan_buckets,
        optimizer_impl=engine_opts.optimizer_impl, sp=sp, tp=tp, model=model_spec, seq_len=seq_len,
    ))
    # The training spec's seq_len only matters when given: a task brings its own, and a plain
    # script's is unknown without --seq-len (then no tokens/s and no estimate).
    training = resolve_training(precision=training_opts.precision, optimizer=training_opts.optimizer, seq_len=seq_len or 2048,
                                micro_batch=None, global_batch=None, grad_accum=None)
    request = ProbeRequest(
        script=script, nproc=nproc, backend=backend, ds_config=setup.ds_config, plan=setup.plan,
        training=training if (seq_len is not None or script_kind(script) == "task") else None, model=model_spec,
        script_args=tuple(ctx.args), config_arg=config_arg, steps=steps, warmup=warmup, timeout_s=timeout, workdir=workdir,
        torchrun_args=torchrun_args, seq_len=seq_len, nodes=nodes, optimizer_impl=engine_opts.optimizer_impl, loss=engine_opts.loss,
        recipe=recipe_opts.resolve(), peft_flags=peft_flags, launcher=local_launcher(launcher),
    )
    result = _run(request, verbose=verbose)
    _report(result, setup.plan, fmt=fmt, output=output)
    if result.status != "ok":
        raise typer.Exit(1)
