"""``zeroplan probe SCRIPT``: run one short probe job and print measured vs estimated.

    zeroplan probe examples/train_deepspeed.py --config ds.json --gpus 2
    zeroplan probe examples/gpt_task.py --stage 3 --micro-batch 2 --gpus 2 --backend fsdp
    zeroplan probe train.py --config ds.json --config-arg --deepspeed -- --model_name gpt2

Exit 0 when the probe ran its steps, 1 when it failed (oom, error, timeout), 2 on bad input.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from zeroplan.cli.recipe_options import (
    CompletionLenOpt, CriticModelOpt, GenerationsOpt, RecipeOpt, ReferenceOpt, RewardModelOpt, VllmGpuMemoryOpt, VllmSleepOpt, resolve_recipe,
)
from zeroplan.cli import app
from zeroplan.cli.common import (
    require_runtime,
    AllgatherBucketOpt,
    BucketsOpt,
    LossOpt,
    OptimizerImplOpt,
    PrefetchBucketOpt,
    OverlapCommOpt,
    ReduceBucketOpt,
    resolve_engine_options,
    resolve_gpus,
    AdapterOpt,
    BaseQuantOpt,
    CheckpointingOpt,
    RunGpusOpt,
    GpusPerNodeOpt,
    GradAccumOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    MicroBatchOpt,
    ModelOpt,
    OffloadOptimizerOpt,
    OffloadParamOpt,
    OptimizerOpt,
    OutputOpt,
    ParamsOpt,
    PrecisionOpt,
    StageOpt,
    TrainableParamsOpt,
    check_choice_option,
    check_plan_options,
    resolve_model,
    resolve_training,
    terminal_width,
    write_output,
)
from zeroplan.cli.nodes import LauncherOpt, local_launcher, NnodesOpt, NodeRankOpt, RdzvEndpointOpt, RdzvTimeoutOpt, resolve_nodes
from zeroplan.spec import GiB, SpecError

__all__ = ["probe"]

_PROBE = "Probe"
ConfigOpt = Annotated[
    Optional[Path],
    typer.Option("--config", help="DeepSpeed JSON config (default for a zeroplan task: built from the plan flags).", rich_help_panel=_PROBE),
]
BackendOpt = Annotated[
    str, typer.Option("--backend", "--engine", help="deepspeed | fsdp (fsdp runs zeroplan tasks only); --engine as in estimate and export.", rich_help_panel=_PROBE)
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


def check_probe_config(ds_config: dict, path: Path, *, world_size: int) -> list[str]:
    """Run ``zeroplan validate``'s rules on ``--config`` before anything is launched.

    An error is a SpecError (one line): DeepSpeed would refuse the config too, after seconds of
    start-up per rank (bf16 and fp16 both on: an AssertionError in deepspeed/runtime/config.py
    once the engine is being built). Returns notes for the warnings about what the engine will
    run instead of what the config says (ZP2xx: an NVMe optimizer offload at stage 1-2 runs as a
    CPU offload, deepspeed/runtime/zero/stage_1_and_2.py ``cpu_offload`` for any device but none,
    which is why the plan reads ``z2+opt:cpu``).
    """
    from zeroplan.dsconfig import validate_config

    findings = validate_config(ds_config, world_size=world_size)
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        first = errors[0]
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise SpecError(
            f"--config {path}: {first.rule_id} {first.message}; {first.fix}{more}; nothing launched "
            f"(zeroplan validate {path} --gpus {world_size} lists every problem)"
        )
    return [f"{f.rule_id}: {f.message}" for f in findings if f.severity == "warning" and f.rule_id.startswith("ZP2")]


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def probe(
    ctx: typer.Context,
    script: Annotated[Path, typer.Argument(help="DeepSpeed training script, or a zeroplan task (defines zeroplan_task()).")],
    config: ConfigOpt = None,
    gpus: RunGpusOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    backend: BackendOpt = "deepspeed",
    steps: StepsOpt = 5,
    warmup: WarmupOpt = 2,
    timeout: TimeoutOpt = 300.0,
    config_arg: ConfigArgOpt = "--deepspeed_config",
    workdir: WorkdirOpt = None,
    torchrun_arg: TorchrunArgOpt = None,
    params: ParamsOpt = None,
    model: ModelOpt = None,
    seq_len: SeqLenProbeOpt = None,
    micro_batch: MicroBatchOpt = None,
    grad_accum: GradAccumOpt = None,
    precision: PrecisionOpt = "bf16",
    optimizer: OptimizerOpt = "adamw",
    stage: StageOpt = None,
    offload_optimizer: OffloadOptimizerOpt = None,
    offload_param: OffloadParamOpt = None,
    checkpointing: CheckpointingOpt = None,
    optimizer_impl: OptimizerImplOpt = None,
    loss: LossOpt = None,
    recipe: RecipeOpt = None, generations: GenerationsOpt = None, completion_len: CompletionLenOpt = None,
    vllm_gpu_memory: VllmGpuMemoryOpt = None, vllm_sleep: VllmSleepOpt = False, reference: ReferenceOpt = None,
    reward_model: RewardModelOpt = None, critic_model: CriticModelOpt = None,
    buckets: BucketsOpt = "hf",
    reduce_bucket_size: ReduceBucketOpt = None,
    allgather_bucket_size: AllgatherBucketOpt = None,
    prefetch_bucket_size: PrefetchBucketOpt = None,
    overlap_comm: OverlapCommOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    adapter: AdapterOpt = None,
    trainable_params: TrainableParamsOpt = None,
    base_quant: BaseQuantOpt = None,
    format: ProbeFormatOpt = "table",
    output: OutputOpt = None,
    verbose: VerboseOpt = False,
    nnodes: NnodesOpt = 1,
    launcher: LauncherOpt = None,
    node_rank: NodeRankOpt = None,
    rdzv_endpoint: RdzvEndpointOpt = None,
    rdzv_timeout: RdzvTimeoutOpt = 120.0,
    sp: SpProbeOpt = 1,
    tp: TpProbeOpt = 1,
) -> None:
    """Run SCRIPT for a few optimizer steps (ranks forked from a warm process, or torchrun) and print measured vs estimated.

    Script arguments go after `--`. The LoRA options (--lora-rank, --adapter, ...) set the layout
    the estimate uses when the run's own model does not carry one; the trainable count the
    engine reports (requires_grad) comes first. Without CUDA the job runs on CPU over gloo (DS_ACCELERATOR=cpu) and peak memory is live tensor storage per rank.
    """
    from zeroplan.runtime import BACKENDS, ProbeRequest, run_probe
    from zeroplan.dsconfig import load_config, plan_from_config
    from zeroplan.runtime import script_kind
    from zeroplan.spec import Plan

    check_choice_option("--format", format, ("table", "json"))
    check_choice_option("--backend", backend, BACKENDS)
    require_runtime("probe")
    gpus = resolve_gpus(gpus, runs_here=True)
    check_plan_options(stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param, checkpointing=checkpointing)
    bucket_flags = dict(reduce_bucket_size=reduce_bucket_size, allgather_bucket_size=allgather_bucket_size, prefetch_bucket_size=prefetch_bucket_size)
    plan_buckets = resolve_engine_options(
        engine=backend, engine_flag="--backend", optimizer_impl=optimizer_impl, loss=loss, offload_optimizer=offload_optimizer, offload_param=offload_param,
        buckets=buckets, **bucket_flags, overlap_comm=overlap_comm,
    )
    if config is not None and (buckets != "hf" or any(v is not None for v in bucket_flags.values())):
        raise SpecError("bucket sizes come from --config; drop --buckets and --*-bucket-size (they size the config built from --stage)")
    if config is not None and overlap_comm is not None:
        raise SpecError("overlap_comm comes from --config (zero_optimization.overlap_comm); drop --overlap-comm (it sets the config built from --stage)")
    torchrun_args = tuple(torchrun_arg or ())
    nproc, nodes = resolve_nodes(
        gpus=gpus,
        gpus_per_node=gpus_per_node,
        nnodes=nnodes,
        launcher=launcher,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_timeout=rdzv_timeout,
        legacy_torchrun_args=torchrun_args,
    )
    if nodes is not None and workdir is None:
        raise SpecError("a multi-node probe needs --workdir DIR: a folder every node sees at the same path (a shared file system)")
    if nodes is not None:
        nodes.kind.preflight(nodes)  # outside a Slurm allocation / too few nodes: before anything is written
    if not script.is_file():
        raise SpecError(f"script {script} does not exist or is not a file")
    # The reader `zeroplan validate` uses: commented (hjson) configs DeepSpeed accepts are read too.
    ds_config = load_config(config).config if config is not None else None
    if ds_config is not None and (sp > 1 or tp > 1):
        from zeroplan.runtime.rank.layout import apply_probe_layout

        ds_config, _ = apply_probe_layout(ds_config, None, sp=sp, tp=tp, world_size=gpus)
    if ds_config is not None:
        for note in check_probe_config(ds_config, config, world_size=gpus):
            print(f"zeroplan: note: {note}", file=sys.stderr)
    from zeroplan.runtime.measure.peft_source import PeftFlags

    # What needs no model is checked now; a layout that does not fit the model is an error now
    # with --model/--params, and a note beside the measurement for a task's or discovered model.
    peft_flags = PeftFlags(
        lora_rank=lora_rank, lora_targets=lora_targets, lora_alpha=lora_alpha, adapter=adapter,
        trainable_params=trainable_params, base_quant=base_quant, model_arg=model, precision=precision,
    )
    model_spec = resolve_model(params, model) if (params is not None or model is not None) else None
    if model_spec is not None and peft_flags.given:
        model_spec = peft_flags.for_model(model_spec)

    plan = None
    if ds_config is not None:
        # The plan only feeds the estimate beside the measurement: a config it cannot read still
        # runs (the runtime reports why there is no estimate). --micro-batch / --grad-accum fill
        # batch keys the config leaves "auto" (Hugging Face).
        try:
            plan = plan_from_config(
                ds_config, gpus, micro_batch=micro_batch, gradient_accumulation_steps=grad_accum, checkpointing=checkpointing
            )
        except SpecError:
            plan = None
    elif stage is not None:
        plan = Plan(
            stage=stage,
            offload_optimizer=offload_optimizer or "none",
            offload_param=offload_param or "none",
            checkpointing=checkpointing or "none",
            micro_batch=micro_batch or 1,
            gradient_accumulation_steps=grad_accum or 1,
            **plan_buckets,
        )
    elif backend == "fsdp" or ds_config is None:
        raise SpecError("give a DeepSpeed config (--config ds.json) or a plan (--stage 0|1|2|3, --micro-batch ...)")
    if sp > 1 or tp > 1 or plan is not None:
        from zeroplan.runtime.rank.layout import apply_probe_layout

        if backend == "fsdp" and (sp > 1 or tp > 1):
            raise SpecError("--sp and --tp run on --backend deepspeed (Ulysses and AutoTP are DeepSpeed features)")
        ds_config, plan = apply_probe_layout(ds_config, plan, sp=sp, tp=tp, world_size=gpus)
        if plan is not None and (plan.sp > 1 or plan.tp > 1):
            from zeroplan.runtime.rank.layout import check_probe_layout

            check_probe_layout(plan, world_size=gpus, model=model_spec, seq_len=seq_len)
    if backend == "fsdp" and plan is not None and (plan.zero_hpz_partition_size > 1 or plan.zero_quantized_weights or plan.zero_quantized_gradients):
        raise SpecError("--backend fsdp has no ZeRO++ (hpZ, qwZ, qgZ are DeepSpeed features); drop them from the config or use --backend deepspeed")
    if optimizer_impl is not None and plan is not None:
        from zeroplan.estimator.optimizer import resolve_optimizer_impl

        try:
            resolve_optimizer_impl(optimizer_impl, engine=backend, plan=plan)
        except SpecError as exc:
            raise SpecError(f"--optimizer-impl: {exc}") from None
    if seq_len is not None and seq_len < 1:
        raise SpecError(f"--seq-len {seq_len} is not valid; give a whole number >= 1")
    # The training spec's seq_len only matters when given: a task brings its own, and a plain
    # script's is unknown without --seq-len (then no tokens/s and no estimate).
    training = resolve_training(
        precision=precision, optimizer=optimizer, seq_len=seq_len or 2048, micro_batch=None, global_batch=None, grad_accum=None
    )
    request = ProbeRequest(
        script=script,
        nproc=nproc,
        backend=backend,
        ds_config=ds_config,
        plan=plan,
        training=training if (seq_len is not None or script_kind(script) == "task") else None,
        model=model_spec,
        script_args=tuple(ctx.args),
        config_arg=config_arg,
        steps=steps,
        warmup=warmup,
        timeout_s=timeout,
        workdir=workdir,
        torchrun_args=torchrun_args,
        seq_len=seq_len,
        nodes=nodes,
        optimizer_impl=optimizer_impl,
        loss=loss,
        recipe=resolve_recipe(recipe, generations=generations, completion_len=completion_len, vllm_gpu_memory=vllm_gpu_memory,
                              vllm_sleep=vllm_sleep, reference=reference, reward_model=reward_model, critic_model=critic_model),
        peft_flags=peft_flags if peft_flags.given else None,
        launcher=local_launcher(launcher),
    )

    from rich.console import Console

    err_console = Console(stderr=True)
    from zeroplan.runtime.rank.dsops import lock_report

    for note in lock_report():  # probes build in their own folder; the user's own runs would wait on these
        print(f"zeroplan: note: {note}", file=sys.stderr)
    if verbose:
        result = run_probe(request, on_line=lambda line: print(line, file=sys.stderr))
    else:
        with err_console.status(f"probing {script.name} on {nproc} processes ({backend}) ...") as status:
            def show(line: str) -> None:
                status.update(f"probing {script.name} ({backend}): {line[:100]}")

            result = run_probe(request, on_line=show)

    if format == "json":
        write_output(json.dumps(result.as_dict(), indent=2), output)
    elif output is None:
        _render_table(result, plan, Console(width=terminal_width(120)))
    else:
        console = Console(file=io.StringIO(), width=120)
        _render_table(result, plan, console)
        write_output(console.file.getvalue(), output)
    if result.status != "ok":
        raise typer.Exit(1)
