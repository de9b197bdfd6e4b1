"""``zeroplan tune SCRIPT``: search plans with real probes and write the best validated config."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from zeroplan.cli import app
from zeroplan.cli.common import RunGpusOpt, check_choice_option, require_runtime, stdout_console, terminal_width
from zeroplan.cli.context_option import CpRefusedOpt, refuse_context_parallel
from zeroplan.cli.options import (
    ClusterOptions, EngineOptions, ModelOptions, PeftGroup, PlanOptions, RecipeOptions, Take, TrainingOptions, grouped,
)
from zeroplan.cli.nodes import LauncherOpt, local_launcher, NnodesOpt, NodeRankOpt, RdzvEndpointOpt, RdzvTimeoutOpt, follow_node0, resolve_nodes, write_sbatch
from zeroplan.cli.tune_summary import print_summary
from zeroplan.cli.tune_view import TuneRender
from zeroplan.spec import RUNNABLE_ENGINES, SpecError

__all__ = ["tune"]

_TUNE = "Tuning"

SeqLenTuneOpt = Annotated[
    Optional[int],
    typer.Option("--seq-len", help="Tokens per sample [default: the task's, else 2048].", rich_help_panel="Training"),
]


def _parse_bucket_sizes(text: Optional[str]) -> tuple[int, ...]:
    if not text:
        return ()
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise SpecError(f"--bucket-sizes {text!r}: {part!r} is not a number; give e.g. 5e7,2e8,5e8") from None
        if not value >= 1 or value > 1e12 or value != int(value):
            raise SpecError(f"--bucket-sizes {text!r}: {part!r} is not a whole number of elements in [1, 1e12]")
        out.append(int(value))
    return tuple(sorted(set(out)))


TrialsOpt = Annotated[int, typer.Option("--trials", help="Probes the study should hold (pruned plans do not count).", rich_help_panel=_TUNE)]
TimeBudgetOpt = Annotated[Optional[float], typer.Option("--time-budget", help="Wall-clock seconds for the search: no probe starts that would end past it; at the end, the predicted gap to the best plan not probed.", rich_help_panel=_TUNE)]
TuneTimeoutOpt = Annotated[float, typer.Option("--timeout", help="Seconds per probe before it is killed (status timeout).", rich_help_panel=_TUNE)]
TuneOutputOpt = Annotated[Path, typer.Option("--output", "-o", help="Folder for ds_config.json, trials.csv, report.md, throughput.png and study.db.", rich_help_panel=_TUNE)]
StorageOpt = Annotated[Optional[str], typer.Option("--storage", help="Optuna RDB URL (sqlite:///x.db, postgresql://...) or a journal file path [default: OUTPUT/study.db].", rich_help_panel=_TUNE)]
ResumeOpt = Annotated[bool, typer.Option("--resume", help="Continue the study in the storage (also: join it as another worker).", rich_help_panel=_TUNE)]
TuneConfigOpt = Annotated[Optional[Path], typer.Option("--config", help="Your DeepSpeed config: the base of every trial (only the tuned keys change).", rich_help_panel=_TUNE)]
TuneConfigArgOpt = Annotated[str, typer.Option("--config-arg", help="How a DeepSpeed script takes its config (--deepspeed for HF Trainer).", rich_help_panel=_TUNE)]
TuneNvmePathOpt = Annotated[Optional[str], typer.Option("--nvme-path", help="Folder on an NVMe drive: adds nvme offload to the search.", rich_help_panel=_TUNE)]
BucketSizesOpt = Annotated[Optional[str], typer.Option("--bucket-sizes", help="Also tune reduce_bucket_size over these element counts, e.g. 5e7,5e8.", rich_help_panel=_TUNE)]
SamplerOpt = Annotated[str, typer.Option("--sampler", help="tpe | random (after the estimator's picks).", rich_help_panel=_TUNE)]
InitialOpt = Annotated[Optional[int], typer.Option("--initial", help="Estimator-ranked plans probed before the sampler [default: half of --trials].", rich_help_panel=_TUNE)]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Sampler seed.", rich_help_panel=_TUNE)]
TuneStepsOpt = Annotated[int, typer.Option("--steps", help="Measured optimizer steps per probe (the most, with --ci).", rich_help_panel=_TUNE)]
TuneWarmupOpt = Annotated[int, typer.Option("--warmup", help="Unmeasured optimizer steps before them.", rich_help_panel=_TUNE)]
EmitSbatchOpt = Annotated[
    Optional[Path],
    typer.Option("--emit-sbatch", help="Write a Slurm batch script that runs this tune with --launcher slurm, and exit.", rich_help_panel="Nodes"),
]
CiOpt = Annotated[float, typer.Option("--ci", help="Stop a probe once its step time's 95% interval is within this fraction (micro-steps timed where accumulation is large); 0: time all --steps.", rich_help_panel=_TUNE)]


#: tune's engine options: ``--engine`` (its old name ``--backend`` hidden) under the Tuning panel.
TuneEngine = Annotated[EngineOptions, Take(options={"engine": Annotated[str, typer.Option(
    "--engine", help="deepspeed | fsdp (fsdp runs zeroplan tasks only); as in estimate and export (old name: --backend).", rich_help_panel=_TUNE)]})]
TuneCluster = Annotated[ClusterOptions, Take(options={"gpus": RunGpusOpt})]
TuneTraining = Annotated[TrainingOptions, Take(options={"seq_len": SeqLenTuneOpt}, defaults={"seq_len": None})]
TunePlan = Annotated[PlanOptions, Take(only=("stage", "offload_optimizer", "offload_param", "checkpointing", "sp", "tp", "ep", "cp"),
                                   options={"cp": CpRefusedOpt})]
TuneRecipe = Annotated[RecipeOptions, Take(only=("recipe", "generations", "completion_len", "vllm_gpu_memory", "vllm_sleep", "reference"))]
ScriptArg = Annotated[Path, typer.Argument(help="Training script: a DeepSpeed script or a zeroplan task (zeroplan_task()).")]
ScriptArgsArg = Annotated[Optional[List[str]], typer.Argument(help="Arguments for the script, after --.", show_default=False)]


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
@grouped
def tune(
    script: ScriptArg, cluster_opts: TuneCluster = None, script_args: ScriptArgsArg = None, model_opts: ModelOptions = None,
    training_opts: TuneTraining = None, plan_opts: TunePlan = None, peft_opts: PeftGroup = None, trials: TrialsOpt = 8,
    time_budget: TimeBudgetOpt = None, timeout: TuneTimeoutOpt = 300.0, engine_opts: TuneEngine = None,
    output: TuneOutputOpt = Path("zeroplan-out"), storage: StorageOpt = None, resume: ResumeOpt = False, config: TuneConfigOpt = None,
    config_arg: TuneConfigArgOpt = "--deepspeed_config", nvme_path: TuneNvmePathOpt = None, bucket_sizes: BucketSizesOpt = None,
    sampler: SamplerOpt = "tpe", initial: InitialOpt = None, seed: SeedOpt = None, steps: TuneStepsOpt = 6,
    warmup: TuneWarmupOpt = 2, nnodes: NnodesOpt = 1, launcher: LauncherOpt = None, node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None, rdzv_timeout: RdzvTimeoutOpt = 120.0, emit_sbatch: EmitSbatchOpt = None,
    recipe_opts: TuneRecipe = None, ci: CiOpt = 0.05,
) -> None:
    """Search ZeRO plans with short real probes; write the best plan's DeepSpeed config, trials.csv and a report."""
    flags = {name: value for name, value in locals().items() if not name.endswith("_opts")}
    for group in (cluster_opts, model_opts, training_opts, plan_opts, peft_opts, engine_opts, recipe_opts):
        flags.update((f.name, getattr(group, f.name)) for f in dataclasses.fields(group))
    request = _request(flags, plan=plan_opts, engine=engine_opts, cluster=cluster_opts, training=training_opts, peft=peft_opts,
                       recipe=recipe_opts)  # every option as parsed, by parameter name, and their groups
    if request is None:
        return  # a Slurm script written, or this node followed node 0's probes
    from zeroplan.tuner.request import NothingFits
    from zeroplan.tuner.usecase import run_tune

    # A stdout its reader closed ends the command quietly (exit 141: zeroplan.cli.main).
    console = stdout_console(highlight=False, width=terminal_width(140))
    try:
        outcome = run_tune(request, TuneRender(console, request.settings.trials))
    except NothingFits as exc:
        _nothing_fits(console, exc.space)
    print_summary(console, outcome.frame, outcome.summary, outcome.output, outcome.gpus, trainer=outcome.trainer)


def _request(flags: dict[str, Any], *, plan: PlanOptions, engine: EngineOptions, cluster: ClusterOptions, training: TrainingOptions,
             peft: PeftGroup, recipe: RecipeOptions) -> Any:
    """The flags checked (in the order the command always checked them) and turned into a
    :class:`~zeroplan.tuner.request.TuneRequest`; None when the run ends here: ``--emit-sbatch``
    wrote its script, or a node other than 0 followed node 0's probes."""
    from zeroplan.runtime import script_kind
    from zeroplan.tuner import TuneSettings, check_tune_precision
    from zeroplan.tuner.request import TuneRequest
    from zeroplan.tuner.space import micro_batch_choices

    f = flags
    script = f["script"]
    plan.check()
    refuse_context_parallel("tune", plan.context_degrees())
    check_choice_option(engine.flag, engine.name, RUNNABLE_ENGINES)
    check_tune_precision(f["precision"])
    gpus = cluster.world(runs_here=True)
    plan_buckets = engine.resolve(plan)
    if not script.is_file():
        raise SpecError(f"script {script} does not exist or is not a file")
    # The batch flags are checked before the task is loaded or this machine measured (seconds each):
    # the training spec's own checks, and --global-batch against --gpus as the space divides it.
    micro_batch_choices(dataclasses.replace(training, seq_len=training.seq_len or 2048).resolve(), gpus)
    if f["timeout"] <= 0:
        raise SpecError(f"--timeout {f['timeout']:g} is not valid; give seconds > 0")
    if f["steps"] < 1 or f["warmup"] < 0:
        raise SpecError("--steps must be >= 1 and --warmup >= 0")
    if not 0 <= f["ci"] < 1:
        raise SpecError(f"--ci {f['ci']:g} is not valid; give a fraction in [0, 1), e.g. 0.05 (0: time all --steps)")
    output = f["output"]
    if output.exists() and not output.is_dir():
        raise SpecError(f"--output {output} is a file; give a folder")
    kind = script_kind(script)
    if engine.name == "fsdp" and kind != "task":
        flag = engine.flag
        raise SpecError(f"{flag} fsdp runs zeroplan tasks only, and {script} defines no zeroplan_task(); use {flag} deepspeed")
    nproc, nodes = _nodes(gpus, f)
    if nproc is None:
        return None
    settings = TuneSettings(trials=f["trials"], time_budget_s=f["time_budget"], n_initial=f["initial"], probe_timeout_s=f["timeout"])
    searched_buckets = _parse_bucket_sizes(f["bucket_sizes"])
    if searched_buckets and f["reduce_bucket_size"] is not None:
        raise SpecError("--bucket-sizes searches reduce_bucket_size and --reduce-bucket-size fixes it; give one of them")
    return TuneRequest(
        script=script, script_kind=kind, gpus=gpus, nproc=nproc, script_args=tuple(f["script_args"] or ()), nodes=nodes,
        launcher=local_launcher(f["launcher"]), gpu=f["gpu"], gpu_memory_gib=f["gpu_memory"], cpu_memory_gib=f["cpu_memory"],
        nvme_gib=f["nvme"], node=f["node"], params=f["params"], model=f["model"], precision=f["precision"],
        peft=peft.spec(),
        optimizer=f["optimizer"], seq_len=f["seq_len"], micro_batch=f["micro_batch"], global_batch=f["global_batch"],
        grad_accum=f["grad_accum"], loss=f["loss"], engine=engine.name, stage=f["stage"], offload_optimizer=f["offload_optimizer"],
        offload_param=f["offload_param"], checkpointing=f["checkpointing"], nvme_path=f["nvme_path"], bucket_sizes=searched_buckets,
        optimizer_impl=f["optimizer_impl"], buckets=plan_buckets, settings=settings, sampler=f["sampler"], seed=f["seed"],
        steps=f["steps"], warmup=f["warmup"], ci=f["ci"], resume=f["resume"], storage=f["storage"], output=output, config=f["config"],
        config_arg=f["config_arg"], layout=plan.layout(), ep=f["ep"], recipe=recipe.resolve(), model_save=f["model_save"],
        model_build=f["model_build"],
    )


def _nodes(gpus: int, f: dict) -> tuple[Any, Any]:
    """(processes per node, the node layout) as resolve_nodes reads the node flags; (None, None)
    when this command ends here (``--emit-sbatch`` written, or node K > 0 followed node 0)."""
    nproc, nodes = resolve_nodes(
        gpus=gpus, gpus_per_node=f["gpus_per_node"], nnodes=f["nnodes"], launcher="slurm" if f["emit_sbatch"] is not None else f["launcher"],
        node_rank=f["node_rank"], rdzv_endpoint=f["rdzv_endpoint"], rdzv_timeout=f["rdzv_timeout"],
    )
    if f["emit_sbatch"] is not None:
        write_sbatch(f["emit_sbatch"], nnodes=f["nnodes"], gpus_per_node=nproc, output=f["output"], time_budget=f["time_budget"])
        return None, None
    require_runtime("tune")
    if nodes is not None and nodes.kind.agent_per_node and nodes.node_rank:
        # Node K > 0: no study, no search; join every probe node 0's tuner starts in the shared
        # --output folder until it is done (zeroplan.runtime.launch.follow.follow_probes).
        follow_node0(f["output"] / "probes", nodes)
        return None, None
    if nodes is not None:
        nodes.kind.preflight(nodes)  # outside a Slurm allocation / too few nodes: before the study opens
    return nproc, nodes


def _nothing_fits(console, space) -> None:
    """Say that the estimator rules out every plan (with the smallest one's reason) and exit 1."""
    closest = min(space.candidates, key=lambda c: c.predicted_gpu_bytes)
    console.print(
        f"[bold red]nothing fits[/]: all {len(space.candidates)} plans are ruled out by the estimator; "
        f"the smallest, {closest.plan.label}, {closest.reason.removeprefix('does not fit: ')}"
    )
    raise typer.Exit(1)
