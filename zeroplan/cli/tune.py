"""``zeroplan tune SCRIPT``: search plans with real probes and write the best validated config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, List, Optional

import typer

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
    StageOpt,
    check_choice_option,
    check_plan_options,
    resolve_cluster,
    resolve_model,
    resolve_training,
    terminal_width,
)
from zeroplan.cli.nodes import LauncherOpt, local_launcher, NnodesOpt, NodeRankOpt, RdzvEndpointOpt, RdzvTimeoutOpt, follow_node0, resolve_nodes, write_sbatch
from zeroplan.cli.tune_summary import best_text, print_summary
from zeroplan.cli.tune_view import LiveView
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
    ci: Annotated[float, typer.Option("--ci", help="Stop a probe once its step time's 95% interval is within this fraction (micro-steps timed where accumulation is large); 0: time all --steps.", rich_help_panel=_TUNE)] = 0.1,
) -> None:
    """Search ZeRO plans with short real probes; write the best plan's DeepSpeed config, trials.csv and a report."""
    from zeroplan.runtime import script_kind
    from zeroplan.tuner import (
        ProbeRunner,
        TuneSettings,
        Tuner,
        check_tune_precision,
        make_sampler,
        open_study,
        storage_url,
        tune_space,
        write_results,
    )
    from zeroplan.tuner.checks import cuda_visible, task_declaration

    check_plan_options(stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param, checkpointing=checkpointing)
    check_choice_option("--backend", backend, ("deepspeed", "fsdp"))
    check_tune_precision(precision)
    gpus = resolve_gpus(gpus, runs_here=True)
    plan_buckets = resolve_engine_options(
        engine=backend, engine_flag="--backend", optimizer_impl=optimizer_impl, loss=loss, offload_optimizer=offload_optimizer, offload_param=offload_param,
        buckets=buckets, reduce_bucket_size=reduce_bucket_size, allgather_bucket_size=allgather_bucket_size,
        prefetch_bucket_size=prefetch_bucket_size, overlap_comm=overlap_comm,
    )
    if not script.is_file():
        raise SpecError(f"script {script} does not exist or is not a file")
    # The batch flags are checked before the task is loaded or this machine measured (seconds each):
    # the training spec's own checks, and --global-batch against --gpus as the space divides it.
    from zeroplan.tuner.space import micro_batch_choices

    micro_batch_choices(
        resolve_training(precision=precision, optimizer=optimizer, seq_len=seq_len or 2048, micro_batch=micro_batch,
                         global_batch=global_batch, grad_accum=grad_accum),
        gpus,
    )
    if timeout <= 0:
        raise SpecError(f"--timeout {timeout:g} is not valid; give seconds > 0")
    if steps < 1 or warmup < 0:
        raise SpecError("--steps must be >= 1 and --warmup >= 0")
    if not 0 <= ci < 1:
        raise SpecError(f"--ci {ci:g} is not valid; give a fraction in [0, 1), e.g. 0.05 (0: time all --steps)")
    if output.exists() and not output.is_dir():
        raise SpecError(f"--output {output} is a file; give a folder")
    args = tuple(script_args or ())
    kind = script_kind(script)
    if backend == "fsdp" and kind != "task":
        raise SpecError(f"--backend fsdp runs zeroplan tasks only, and {script} defines no zeroplan_task(); use --backend deepspeed")
    nproc, nodes = resolve_nodes(
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        nnodes=nnodes,
        launcher="slurm" if emit_sbatch is not None else launcher,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_timeout=rdzv_timeout,
    )
    if emit_sbatch is not None:
        write_sbatch(emit_sbatch, nnodes=nnodes, gpus_per_node=nproc, output=output, time_budget=time_budget)
        return
    require_runtime("tune")
    if nodes is not None and nodes.launcher == "torchrun" and nodes.node_rank:
        # Node K > 0: no study, no search; join every probe node 0's tuner starts in the shared
        # --output folder until it is done (zeroplan.runtime.follow.follow_probes).
        follow_node0(output / "probes", nodes)
        return
    if nodes is not None and nodes.launcher == "slurm":
        from zeroplan.runtime.multinode import slurm_allocation

        slurm_allocation(nodes.nnodes)  # outside an allocation / too few nodes: before the study opens
    settings = TuneSettings(trials=trials, time_budget_s=time_budget, n_initial=initial, probe_timeout_s=timeout)
    searched_buckets = _parse_bucket_sizes(bucket_sizes)
    if searched_buckets and reduce_bucket_size is not None:
        raise SpecError("--bucket-sizes searches reduce_bucket_size and --reduce-bucket-size fixes it; give one of them")
    # Open the study first: a corrupt, locked or refused storage fails before any slow work.
    output.mkdir(parents=True, exist_ok=True)
    if nodes is not None and nodes.launcher == "torchrun":
        from zeroplan.runtime import FOLLOW_DONE

        (output / "probes" / FOLLOW_DONE).unlink(missing_ok=True)  # followers wait for this run's end
    url = storage_url(storage, output)
    study = open_study(url, resume=resume, sampler=make_sampler(sampler, seed=seed))

    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=False, highlight=False, width=terminal_width(140))

    # A Trainer script (transformers/TRL) takes --deepspeed; every trial starts from the user's
    # config, else (Trainer) from the "auto" template, else from zeroplan's complete config.
    from zeroplan.dsconfig.trial import base_for_script, with_overlap_comm
    from zeroplan.runtime.trainer import TRAINER_CONFIG_ARG, is_trainer_script, trainer_precision

    trainer = kind == "script" and is_trainer_script(script)
    if trainer and config_arg == "--deepspeed_config":
        config_arg = TRAINER_CONFIG_ARG
    user_base = None
    if config is not None:
        from zeroplan.dsconfig import load_config

        user_base = load_config(config).config
    base_config = base_for_script(user_base, trainer=trainer)
    if "overlap_comm" in plan_buckets:
        base_config = with_overlap_comm(base_config, plan_buckets["overlap_comm"])
    if user_base is not None and not trainer:
        from zeroplan.dsconfig.hf_auto import auto_keys

        autos = [k for k in auto_keys(user_base) if k not in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
        if autos:
            # Only Trainer (and accelerate, for some keys) fill "auto"; DeepSpeed itself fails on them.
            console.print(
                f"[yellow]note[/]: {escape(str(config))} keeps \"auto\" at {', '.join(autos[:4])}{' ...' if len(autos) > 4 else ''}; "
                f"{escape(script.name)} is not a Hugging Face Trainer script, so unless it fills them (accelerate does for some) DeepSpeed will refuse the config",
                markup=True, highlight=False,
            )
    if trainer:
        # What "auto" resolves to: the script's --bf16/--fp16, unless the config says.
        precision = trainer_precision(args, base_config)

    # Model: --params/--model, else what the task declares, else discovered from the script.
    task_seq_len = None
    task_loss = None
    discovered_seq_len = None
    activation_bytes = None  # the transformer formula, unless a discovered model brings its trace
    model_origin = "given"
    if params is None and model is None:
        if kind == "task":
            declared = task_declaration(script, args)
            model_spec, task_seq_len, task_loss = declared.model_spec, declared.seq_len, declared.loss
            if model_spec is None:
                raise SpecError(f"the task in {script} declares no model_spec; give --params or --model")
            model_origin = "declared by the task"
        else:
            from zeroplan.runtime.discover import discovered_or_cached, discovery_config

            draft = resolve_training(precision=precision, optimizer=optimizer, seq_len=seq_len or 2048, micro_batch=None, global_batch=None, grad_accum=None)
            with console.status(f"discovering the model: running {script.name} once until it creates its engine ..."):
                found, cached = discovered_or_cached(
                    script, output_dir=output, script_args=args, config_arg=config_arg,
                    ds_config=discovery_config(draft, user_base, trainer=trainer), timeout_s=timeout,
                )
            model_spec = found.model_spec()
            discovered_seq_len = found.seq_len
            activation_bytes = found.activation_bytes()  # a model that is not a transformer: its trace
            model_origin = "discovered" + (" (cached)" if cached else "")
            console.print(f"model {escape(found.describe())}" + (" [dim](cached)[/]" if cached else ""))
            from zeroplan.runtime.recipe_discovery import recipe_lines

            for line in recipe_lines(found.trainer, found.recipe, found.frozen_engines):
                console.print(escape(line), highlight=False)
    else:
        # A LoRA/QLoRA run: the space and its pruning see the trainable count (docs/peft.md).
        model_spec = PeftOptions(lora_rank, lora_targets, lora_alpha, adapter, trainable_params, base_quant).apply(
            resolve_model(params, model), model, precision=precision
        )
        if kind == "task":
            declared = task_declaration(script, args)
            task_seq_len, task_loss = declared.seq_len, declared.loss
    if seq_len is not None and task_seq_len is not None and seq_len != task_seq_len:
        raise SpecError(f"--seq-len {seq_len} differs from the task's sequence length {task_seq_len}; pass it to the task after --")
    seq_origin = "given" if seq_len else "the task's" if task_seq_len else "from the first batch" if discovered_seq_len else "default"
    training = resolve_training(
        precision=precision,
        optimizer=optimizer,
        seq_len=seq_len or task_seq_len or discovered_seq_len or 2048,
        micro_batch=micro_batch,
        global_batch=global_batch,
        grad_accum=grad_accum,
    )
    # What the loss keeps over the logits: --loss, else the task's Task(loss=...), as a probe's
    # estimate reads it (runtime.prediction); else the estimator's default.
    from dataclasses import replace as _replace

    loss_origin = "given" if loss else "declared by the task" if task_loss else "default"
    training = _replace(training, loss=loss or task_loss or training.loss)
    cluster = resolve_cluster(
        gpus=gpus, gpus_per_node=nproc, gpu=gpu, gpu_memory_gib=gpu_memory, cpu_memory_gib=cpu_memory, nvme_gib=nvme, node=node, runs_here=True
    )
    on_cuda = cuda_visible()
    from zeroplan.tuner.cpu_profile import time_model_for_probes
    from zeroplan.tuner.probetime import probe_floor_s, probes_in_budget, startup_floor_s

    runner = ProbeRunner(
        script=script,
        nproc=nproc,
        nodes=nodes,
        training=training,
        model=model_spec,
        workdir=output / "probes",
        backend=backend,
        script_args=args,
        config_arg=config_arg,
        steps=steps,
        warmup=warmup,
        timeout_s=timeout,
        nvme_path=nvme_path,
        target_ci=ci or None,
        base_config=base_config,
        optimizer_impl=optimizer_impl,
        loss=loss or task_loss,
        launcher=local_launcher(launcher),
    )
    space_options = dict(
        script_kind=kind,
        stage=stage,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        checkpointing=checkpointing,
        nvme_path=nvme_path,
        bucket_sizes=searched_buckets,
        device="cuda" if on_cuda else "cpu",
        engine=backend,
        optimizer_impl=optimizer_impl,
        buckets=plan_buckets,
        base_config=base_config,
        activation_bytes=activation_bytes,
    )
    # The warm server imports torch and DeepSpeed while this process estimates the plans and imports
    # torch for the time model; it is idle (imports done) before this CPU is measured, then loads the rest.
    warm_ready = runner.begin_warm_server()
    # Which plans fit is memory alone: known before this CPU is measured (seconds), so a run where
    # nothing fits stops here; the space is ranked again below with the measured speeds.
    space = tune_space(model_spec, cluster, training, **space_options)
    console.print(f"[dim]loss: {training.loss} ({loss_origin}; --loss sets it), for the estimates that prune and rank plans[/]")
    if not space.fitting:
        _nothing_fits(console, space)
    if space.tight:
        from zeroplan.estimator.verdict import TIGHT_MARGIN

        console.print(f"[dim]{len(space.tight)} of {len(space.fitting)} plans that fit are tight (within {TIGHT_MARGIN * 100:.0f} % of the "
                      f"GPU's or the node's memory): they are probed only after the {len(space.fitting) - len(space.tight)} "
                      "that fit with margin[/]")
    warm_s: list = []
    measured, time_model = time_model_for_probes(cluster, on_cuda=on_cuda, gpu_given=gpu is not None or node is not None,
                                                 before_measuring=lambda: warm_s.append(warm_ready()))
    if not warm_s:
        warm_s.append(warm_ready())
    if measured is not cluster:
        cluster = measured
        space = tune_space(model_spec, cluster, training, **space_options)

    meta = {
        "script": " ".join([str(script), *args]),
        "backend": backend + ("" if on_cuda else " (CPU, gloo)"),
        "gpus": cluster.gpus,
        "model": f"{model_spec.name} ({model_spec.params:,} params, {model_origin})",
        "global_batch": training.global_batch,
        "seq_len": f"{training.seq_len} ({seq_origin})",
        "precision": training.precision,
        "loss": f"{training.loss} ({loss_origin})",
        "storage": url,
        "sampler": f"{sampler} after {settings.initial} estimator picks",
        "time_model": time_model.removeprefix("time model: "),
        "plans": len(space.candidates),
        "pruned": len(space.pruned),
    }
    if not space.fitting:
        _nothing_fits(console, space)
    # A probe's start-up is at least the warm server's start (torch and DeepSpeed imported), else a
    # fresh interpreter importing torch: it bounds the budget and derives the first probes'
    # timeouts (before any probe has been measured).
    startup_floor = warm_s[0] if warm_s[0] is not None else startup_floor_s()
    runner.predicted_step_time = space.predicted_step_time
    runner.startup_floor_s = startup_floor
    if time_budget is not None:
        floor = probe_floor_s(space.fitting[0].predicted_step_time_s, startup_s=startup_floor, optimizer_steps=warmup + 1)
        fit = probes_in_budget(time_budget, floor)
        console.print(f"[dim]time budget {time_budget:g} s: one probe takes at least {floor:.0f} s here, so at most {fit} probes "
                      f"(no probe starts that its expected duration would take past the budget)[/]")
    if backend == "deepspeed":  # after the budget check: a budget too small for one probe says so at once
        _build_optimizer_ops(console, space, training, base_config=base_config, optimizer_impl=optimizer_impl)
    view = LiveView(console, settings.trials)

    def after_trial() -> None:
        write_results(tuner.ledger.trials(), output, meta)

    tuner = Tuner(study, space, runner, settings, on_event=view.event, after_trial=after_trial, expected_probe_s=runner.expected_s)
    console.print(f"[dim]{time_model}[/]")
    for message in tuner.prepare(resume=resume):
        console.print(f"[dim]{message}[/]")
    from zeroplan.tuner.results import PLOT_MISSING, plotting_available

    if not plotting_available():
        console.print(f"[yellow]note[/]: {escape(PLOT_MISSING)}; every other output is written")
    view.done = tuner.probes_in_study()
    view.best = best_text(tuner)
    best_so_far = tuner.best()
    view.best_value = best_so_far.value if best_so_far is not None else 0.0
    try:
        with view.live():
            summary = tuner.run()
    except KeyboardInterrupt:
        write_results(study.get_trials(deepcopy=False), output, meta)
        console.print(f"[yellow]interrupted[/]: the study in {url} is intact; run again with --resume to continue")
        raise
    finally:
        if nodes is not None and nodes.launcher == "torchrun":
            from zeroplan.runtime import FOLLOW_DONE

            (output / "probes").mkdir(parents=True, exist_ok=True)
            (output / "probes" / FOLLOW_DONE).touch()  # the other nodes' followers stop
    from zeroplan.tuner.search import REMEASURED_ATTR

    frame = write_results(study.get_trials(deepcopy=False), output, meta, remeasured=study.user_attrs.get(REMEASURED_ATTR))
    print_summary(console, frame, summary, output, cluster.gpus, trainer=trainer)


def _nothing_fits(console, space) -> None:
    """Say that the estimator rules out every plan (with the smallest one's reason) and exit 1."""
    closest = min(space.candidates, key=lambda c: c.predicted_gpu_bytes)
    console.print(
        f"[bold red]nothing fits[/]: all {len(space.candidates)} plans are ruled out by the estimator; "
        f"the smallest, {closest.plan.label}, {closest.reason.removeprefix('does not fit: ')}"
    )
    raise typer.Exit(1)


def _escape_line(text: str) -> str:
    """``text`` as one line for rich (markup escaped)."""
    from rich.markup import escape

    return escape(" ".join(text.split()))


def _build_optimizer_ops(console, space, training, *, base_config, optimizer_impl) -> None:
    """Compile the DeepSpeed optimizer ops the fitting plans load, once, before the first probe
    (zeroplan.runtime.dsops.build_ops), and say how long it took: apart from every probe."""
    from zeroplan.runtime.dsops import build_ops, optimizer_ops_for, unbuilt_ops

    block = (base_config is None or "optimizer" in base_config) and optimizer_impl not in ("torch", "torch-fused") \
        and training.optimizer in ("adam", "adamw")
    missing = unbuilt_ops(optimizer_ops_for([c.plan for c in space.fitting], optimizer_block=block))
    if not missing:
        return
    names = ", ".join(b.removesuffix("Builder") for b in missing)
    import subprocess

    with console.status(f"compiling DeepSpeed's {names} op (first use on this machine; a few minutes on CPUs) ..."):
        try:
            built = build_ops(missing)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            console.print(f"[yellow]note[/]: {_escape_line(str(exc))}; the probes that need it will report it")
            return
    if built:
        console.print(f"[dim]compiled DeepSpeed's {', '.join(f'{k} in {v:.0f} s' for k, v in built.items())}, once for this machine; "
                      "not part of any probe[/]")
