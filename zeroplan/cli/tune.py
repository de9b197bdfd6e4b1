"""``zeroplan tune SCRIPT``: search plans with real probes and write the best validated config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer

from zeroplan.cli.recipe_options import (
    CompletionLenOpt, GenerationsOpt, RecipeOpt, ReferenceOpt, VllmGpuMemoryOpt, VllmSleepOpt, resolve_recipe,
)
from zeroplan.cli import app
from zeroplan.cli.common import (
    require_runtime,
    AdapterOpt,
    AllgatherBucketOpt,
    BucketsOpt,
    LossOpt,
    OptimizerImplOpt,
    PrefetchBucketOpt,
    OverlapCommOpt,
    ReduceBucketOpt,
    resolve_engine_options,
    resolve_gpus,
    BaseQuantOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    TrainableParamsOpt,
    CheckpointingOpt,
    CpuMemoryOpt,
    GlobalBatchOpt,
    GpuMemoryOpt,
    GpuOpt,
    RunGpusOpt,
    GpusPerNodeOpt,
    GradAccumOpt,
    MicroBatchOpt,
    ModelOpt,
    NodeOpt,
    NvmeOpt,
    OffloadOptimizerOpt,
    OffloadParamOpt,
    OptimizerOpt,
    ParamsOpt,
    PeftOptions,
    PrecisionOpt,
    SpOpt,
    StageOpt,
    TpOpt,
    check_choice_option,
    check_plan_options,
    resolve_layout_options,
    resolve_training,
    terminal_width,
)
from zeroplan.cli.expert_option import EpOpt
from zeroplan.cli.nodes import LauncherOpt, local_launcher, NnodesOpt, NodeRankOpt, RdzvEndpointOpt, RdzvTimeoutOpt, follow_node0, resolve_nodes, write_sbatch
from zeroplan.cli.tune_summary import print_summary
from zeroplan.cli.tune_view import TuneRender
from zeroplan.spec import SpecError

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


@app.command(context_settings={"help_option_names": ["-h", "--help"]})
def tune(
    script: Annotated[Path, typer.Argument(help="Training script: a DeepSpeed script or a zeroplan task (zeroplan_task()).")],
    gpus: RunGpusOpt = None,
    script_args: Annotated[Optional[List[str]], typer.Argument(help="Arguments for the script, after --.", show_default=False)] = None,
    gpus_per_node: GpusPerNodeOpt = None,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    cpu_memory: CpuMemoryOpt = None,
    node: NodeOpt = None,
    nvme: NvmeOpt = None,
    params: ParamsOpt = None,
    model: ModelOpt = None,
    seq_len: SeqLenTuneOpt = None,
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
    ep: EpOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    adapter: AdapterOpt = None,
    trainable_params: TrainableParamsOpt = None,
    base_quant: BaseQuantOpt = None,
    trials: Annotated[int, typer.Option("--trials", help="Probes the study should hold (pruned plans do not count).", rich_help_panel=_TUNE)] = 8,
    time_budget: Annotated[Optional[float], typer.Option("--time-budget", help="Wall-clock seconds for the search: no probe starts that would end past it; at the end, the predicted gap to the best plan not probed.", rich_help_panel=_TUNE)] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per probe before it is killed (status timeout).", rich_help_panel=_TUNE)] = 300.0,
    backend: Annotated[str, typer.Option("--backend", "--engine", help="deepspeed | fsdp (fsdp runs zeroplan tasks only); --engine as in estimate and export.", rich_help_panel=_TUNE)] = "deepspeed",
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for ds_config.json, trials.csv, report.md, throughput.png and study.db.", rich_help_panel=_TUNE)] = Path("zeroplan-out"),
    storage: Annotated[Optional[str], typer.Option("--storage", help="Optuna RDB URL (sqlite:///x.db, postgresql://...) or a journal file path [default: OUTPUT/study.db].", rich_help_panel=_TUNE)] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the study in the storage (also: join it as another worker).", rich_help_panel=_TUNE)] = False,
    config: Annotated[Optional[Path], typer.Option("--config", help="Your DeepSpeed config: the base of every trial (only the tuned keys change).", rich_help_panel=_TUNE)] = None,
    config_arg: Annotated[str, typer.Option("--config-arg", help="How a DeepSpeed script takes its config (--deepspeed for HF Trainer).", rich_help_panel=_TUNE)] = "--deepspeed_config",
    nvme_path: Annotated[Optional[str], typer.Option("--nvme-path", help="Folder on an NVMe drive: adds nvme offload to the search.", rich_help_panel=_TUNE)] = None,
    bucket_sizes: Annotated[Optional[str], typer.Option("--bucket-sizes", help="Also tune reduce_bucket_size over these element counts, e.g. 5e7,5e8.", rich_help_panel=_TUNE)] = None,
    optimizer_impl: OptimizerImplOpt = None,
    loss: LossOpt = None,
    buckets: BucketsOpt = "hf",
    reduce_bucket_size: ReduceBucketOpt = None,
    allgather_bucket_size: AllgatherBucketOpt = None,
    prefetch_bucket_size: PrefetchBucketOpt = None,
    overlap_comm: OverlapCommOpt = None,
    sampler: Annotated[str, typer.Option("--sampler", help="tpe | random (after the estimator's picks).", rich_help_panel=_TUNE)] = "tpe",
    initial: Annotated[Optional[int], typer.Option("--initial", help="Estimator-ranked plans probed before the sampler [default: half of --trials].", rich_help_panel=_TUNE)] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Sampler seed.", rich_help_panel=_TUNE)] = None,
    steps: Annotated[int, typer.Option("--steps", help="Measured optimizer steps per probe.", rich_help_panel=_TUNE)] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Unmeasured optimizer steps before them.", rich_help_panel=_TUNE)] = 2,
    nnodes: NnodesOpt = 1,
    launcher: LauncherOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None,
    rdzv_timeout: RdzvTimeoutOpt = 120.0,
    emit_sbatch: Annotated[
        Optional[Path],
        typer.Option("--emit-sbatch", help="Write a Slurm batch script that runs this tune with --launcher slurm, and exit.", rich_help_panel="Nodes"),
    ] = None,
    recipe: RecipeOpt = None, generations: GenerationsOpt = None, completion_len: CompletionLenOpt = None,
    vllm_gpu_memory: VllmGpuMemoryOpt = None, vllm_sleep: VllmSleepOpt = False, reference: ReferenceOpt = None,
    ci: Annotated[float, typer.Option("--ci", help="Stop a probe once its step time's 95% interval is within this fraction (micro-steps timed where accumulation is large); 0: time all --steps.", rich_help_panel=_TUNE)] = 0.1,
) -> None:
    """Search ZeRO plans with short real probes; write the best plan's DeepSpeed config, trials.csv and a report."""
    request = _request(dict(locals()))  # every option as parsed, by parameter name
    if request is None:
        return  # a Slurm script written, or this node followed node 0's probes
    from rich.console import Console

    from zeroplan.tuner.request import NothingFits
    from zeroplan.tuner.usecase import run_tune

    console = Console(stderr=False, highlight=False, width=terminal_width(140))
    try:
        outcome = run_tune(request, TuneRender(console, request.settings.trials))
    except NothingFits as exc:
        _nothing_fits(console, exc.space)
    print_summary(console, outcome.frame, outcome.summary, outcome.output, outcome.gpus, trainer=outcome.trainer)


def _request(flags: dict[str, Any]) -> Any:
    """The flags checked (in the order the command always checked them) and turned into a
    :class:`~zeroplan.tuner.request.TuneRequest`; None when the run ends here: ``--emit-sbatch``
    wrote its script, or a node other than 0 followed node 0's probes."""
    from zeroplan.runtime import script_kind
    from zeroplan.tuner import TuneSettings, check_tune_precision
    from zeroplan.tuner.request import TuneRequest
    from zeroplan.tuner.space import micro_batch_choices

    f = flags
    script = f["script"]
    check_plan_options(stage=f["stage"], offload_optimizer=f["offload_optimizer"], offload_param=f["offload_param"], checkpointing=f["checkpointing"])
    check_choice_option("--backend", f["backend"], ("deepspeed", "fsdp"))
    check_tune_precision(f["precision"])
    gpus = resolve_gpus(f["gpus"], runs_here=True)
    plan_buckets = resolve_engine_options(
        engine=f["backend"], engine_flag="--backend", optimizer_impl=f["optimizer_impl"], loss=f["loss"], offload_optimizer=f["offload_optimizer"],
        offload_param=f["offload_param"], buckets=f["buckets"], reduce_bucket_size=f["reduce_bucket_size"],
        allgather_bucket_size=f["allgather_bucket_size"], prefetch_bucket_size=f["prefetch_bucket_size"], overlap_comm=f["overlap_comm"],
    )
    if not script.is_file():
        raise SpecError(f"script {script} does not exist or is not a file")
    # The batch flags are checked before the task is loaded or this machine measured (seconds each):
    # the training spec's own checks, and --global-batch against --gpus as the space divides it.
    micro_batch_choices(
        resolve_training(precision=f["precision"], optimizer=f["optimizer"], seq_len=f["seq_len"] or 2048, micro_batch=f["micro_batch"],
                         global_batch=f["global_batch"], grad_accum=f["grad_accum"]),
        gpus,
    )
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
    if f["backend"] == "fsdp" and kind != "task":
        raise SpecError(f"--backend fsdp runs zeroplan tasks only, and {script} defines no zeroplan_task(); use --backend deepspeed")
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
        peft=PeftOptions(f["lora_rank"], f["lora_targets"], f["lora_alpha"], f["adapter"], f["trainable_params"], f["base_quant"]),
        optimizer=f["optimizer"], seq_len=f["seq_len"], micro_batch=f["micro_batch"], global_batch=f["global_batch"],
        grad_accum=f["grad_accum"], loss=f["loss"], engine=f["backend"], stage=f["stage"], offload_optimizer=f["offload_optimizer"],
        offload_param=f["offload_param"], checkpointing=f["checkpointing"], nvme_path=f["nvme_path"], bucket_sizes=searched_buckets,
        optimizer_impl=f["optimizer_impl"], buckets=plan_buckets, settings=settings, sampler=f["sampler"], seed=f["seed"],
        steps=f["steps"], warmup=f["warmup"], ci=f["ci"], resume=f["resume"], storage=f["storage"], output=output, config=f["config"],
        config_arg=f["config_arg"], layout=resolve_layout_options(f["sp"], f["tp"]),
        ep=f["ep"],
        recipe=resolve_recipe(f["recipe"], generations=f["generations"], completion_len=f["completion_len"],
                              vllm_gpu_memory=f["vllm_gpu_memory"], vllm_sleep=f["vllm_sleep"], reference=f["reference"]),
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
    if nodes is not None and nodes.launcher == "torchrun" and nodes.node_rank:
        # Node K > 0: no study, no search; join every probe node 0's tuner starts in the shared
        # --output folder until it is done (zeroplan.runtime.follow.follow_probes).
        follow_node0(f["output"] / "probes", nodes)
        return None, None
    if nodes is not None and nodes.launcher == "slurm":
        from zeroplan.runtime.multinode import slurm_allocation

        slurm_allocation(nodes.nnodes)  # outside an allocation / too few nodes: before the study opens
    return nproc, nodes


def _nothing_fits(console, space) -> None:
    """Say that the estimator rules out every plan (with the smallest one's reason) and exit 1."""
    closest = min(space.candidates, key=lambda c: c.predicted_gpu_bytes)
    console.print(
        f"[bold red]nothing fits[/]: all {len(space.candidates)} plans are ruled out by the estimator; "
        f"the smallest, {closest.plan.label}, {closest.reason.removeprefix('does not fit: ')}"
    )
    raise typer.Exit(1)
