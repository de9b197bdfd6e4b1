"""``zeroplan export``: a DeepSpeed JSON config for one plan (stdout, or ``-o FILE`` atomically).

With ``--stage`` and ``--micro-batch`` the plan is taken as given (with a model, a note on stderr
says whether the estimator predicts it fits). Without them a model
(``--params``/``--model``) is needed and export takes the fastest plan the estimator says fits,
within whatever plan options were given.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from zeroplan.cli import app
from zeroplan.cli.common import (
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
    check_choice_option,
    CpuMemoryOpt,
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
    PeftOptions,
    ParamsOpt,
    PrecisionOpt,
    SeqLenOpt,
    SpOpt,
    StageOpt,
    TiledMlpOpt,
    TpOpt,
    resolve_layout_options,
    check_plan_options,
    resolve_cluster,
    resolve_model,
    resolve_training,
    write_output,
)
from zeroplan.dsconfig.layout_keys import accelerate_parallelism_entries, trainer_layout_settings
from zeroplan.estimator.layout_space import explicit_layout
from zeroplan.cli.expert_option import EpOpt
from zeroplan.cli.recipe_options import (
    CompletionLenOpt, CriticModelOpt, GenerationsOpt, RecipeOpt, ReferenceOpt, RewardModelOpt, VllmGpuMemoryOpt, VllmSleepOpt, resolve_recipe,
)
from zeroplan.spec import SpecError

__all__ = ["export"]

_PLAN = "Plan"
NvmePathOpt = Annotated[
    Optional[str],
    typer.Option("--nvme-path", help="Directory on the NVMe drive for nvme offload (required with it).", rich_help_panel=_PLAN),
]
LrOpt = Annotated[float, typer.Option("--lr", help="Peak learning rate (optimizer and WarmupLR).", rich_help_panel="Training")]
WarmupOpt = Annotated[int, typer.Option("--warmup-steps", help="Linear warm-up steps of the scheduler.", rich_help_panel="Training")]
TotalStepsOpt = Annotated[
    Optional[int],
    typer.Option("--total-steps", help="Total training steps: switches to WarmupDecayLR (linear decay to 0).", rich_help_panel="Training"),
]
CpuCkptOpt = Annotated[
    bool, typer.Option("--cpu-checkpointing", help="Keep checkpointed activations in host memory.", rich_help_panel=_PLAN)
]


def _note(text: str) -> None:
    print(f"zeroplan: {text}", file=sys.stderr)


@app.command()
def export(
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
    cpu_checkpointing: CpuCkptOpt = False,
    nvme_path: NvmePathOpt = None,
    lr: LrOpt = 1e-4,
    warmup_steps: WarmupOpt = 100,
    total_steps: TotalStepsOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    adapter: AdapterOpt = None,
    trainable_params: TrainableParamsOpt = None,
    base_quant: BaseQuantOpt = None,
    optimizer_impl: OptimizerImplOpt = None,
    loss: LossOpt = None,
    buckets: BucketsOpt = "hf",
    reduce_bucket_size: ReduceBucketOpt = None,
    allgather_bucket_size: AllgatherBucketOpt = None,
    prefetch_bucket_size: PrefetchBucketOpt = None,
    overlap_comm: OverlapCommOpt = None,
    ep: EpOpt = None,
    target: Annotated[
        str, typer.Option("--for", help='deepspeed | hf: hf writes "auto" wherever Hugging Face Trainer fills the value.', rich_help_panel="Output")
    ] = "deepspeed",
    accelerate_config: Annotated[
        Optional[str], typer.Option("--accelerate-config", help="Also write an accelerate YAML that runs DeepSpeed with the exported file (needs --output).", rich_help_panel="Output")
    ] = None,
    engine: Annotated[
        str, typer.Option("--engine", help="deepspeed (a DeepSpeed JSON config) | fsdp (PyTorch DDP/FSDP2 settings as JSON: fully_shard, mixed precision, offload).", rich_help_panel="Output")
    ] = "deepspeed",
    output: OutputOpt = None,
    recipe: RecipeOpt = None, generations: GenerationsOpt = None, completion_len: CompletionLenOpt = None,
    vllm_gpu_memory: VllmGpuMemoryOpt = None, vllm_sleep: VllmSleepOpt = False, reference: ReferenceOpt = None,
    reward_model: RewardModelOpt = None, critic_model: CriticModelOpt = None,
) -> None:
    """Write a DeepSpeed config for a plan (or the fastest plan that fits) that passes validate.

    Consistent batch keys, integer bucket sizes (from the model's hidden size when given),
    offload blocks only where DeepSpeed honours them, optimizer and scheduler blocks.

    Exit code 0 on success, 1 when no plan fits (nothing written), 2 on bad input.
    """
    from zeroplan.dsconfig import build_config_with_notes, has_errors, validate_config
    from zeroplan.spec import Plan

    check_plan_options(stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param, checkpointing=checkpointing)
    recipe_spec = resolve_recipe(recipe, generations=generations, completion_len=completion_len, vllm_gpu_memory=vllm_gpu_memory,
                                 vllm_sleep=vllm_sleep, reference=reference, reward_model=reward_model, critic_model=critic_model)
    if recipe_spec is not None:
        recipe_spec.check_sequence(seq_len)
    check_choice_option("--for", target, ("deepspeed", "hf"))
    check_choice_option("--engine", engine, ("deepspeed", "fsdp"))
    if engine == "fsdp" and (target != "deepspeed" or accelerate_config is not None):
        raise SpecError("--engine fsdp writes PyTorch settings; --for hf and --accelerate-config are for DeepSpeed configs")
    plan_buckets = resolve_engine_options(
        engine=engine, optimizer_impl=optimizer_impl, loss=loss, offload_optimizer=offload_optimizer, offload_param=offload_param,
        buckets=buckets, reduce_bucket_size=reduce_bucket_size, allgather_bucket_size=allgather_bucket_size,
        prefetch_bucket_size=prefetch_bucket_size, overlap_comm=overlap_comm,
    )
    if accelerate_config is not None and output is None:
        raise SpecError("--accelerate-config points accelerate at the exported file: also give --output ds.json")
    gpus = resolve_gpus(gpus, runs_here=False)
    from zeroplan.estimator.expert_parallel import explicit_expert_degree, parse_expert_degrees

    expert_degrees = parse_expert_degrees(ep, engine=engine)
    training = resolve_training(
        precision=precision, optimizer=optimizer, seq_len=seq_len, micro_batch=micro_batch,
        global_batch=global_batch, grad_accum=grad_accum,
    )
    if loss is not None:
        from dataclasses import replace as _replace

        training = _replace(training, loss=loss)
    peft = PeftOptions(lora_rank, lora_targets, lora_alpha, adapter, trainable_params, base_quant)
    model_spec = None
    if params is not None or model is not None:
        model_spec = peft.apply(resolve_model(params, model), model, precision=precision)
    else:
        peft.require_model("need a model: --model NAME or config.json")

    sp_degrees, tp_degrees = resolve_layout_options(sp, tp)
    if stage is not None and micro_batch is not None:
        layout = explicit_layout(sp_degrees, tp_degrees, tiled_mlp=tiled_mlp)
        plan = Plan(
            stage=stage,
            offload_optimizer=offload_optimizer or "none",
            offload_param=offload_param or "none",
            checkpointing=checkpointing or "none",
            micro_batch=micro_batch,
            gradient_accumulation_steps=training.accumulation_for(micro_batch, Plan(stage=stage, **layout).data_parallel(gpus)),
            cpu_checkpointing=cpu_checkpointing,
            **layout,
            ep=explicit_expert_degree(expert_degrees, model_spec, gpus),
            **plan_buckets,
        )
        if plan.model_parallel > 1:
            # The explicit plan obeys the layout rules the plan space enumerates by (not a written
            # config that fails its own validation).
            from zeroplan.estimator.layout_space import check_layout

            cluster = resolve_cluster(gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, gpu_memory_gib=gpu_memory, cpu_memory_gib=cpu_memory,
                                      nvme_gib=nvme, node=node)
            check_layout(model_spec, cluster, training, plan, engine=engine)
        if optimizer_impl is not None:
            from zeroplan.estimator.optimizer import resolve_optimizer_impl

            try:
                resolve_optimizer_impl(optimizer_impl, engine=engine, plan=plan)
            except SpecError as exc:
                raise SpecError(f"--optimizer-impl: {exc}") from None
    else:
        if model_spec is None:
            raise SpecError(
                "give --stage and --micro-batch for an explicit plan, or a model (--params 7e9 / --model NAME) "
                "so export picks the fastest plan that fits"
            )
        from zeroplan.estimator import best_plan
        from zeroplan.profiles.recipe_models import recipe_models

        cluster = resolve_cluster(
            gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, gpu_memory_gib=gpu_memory, cpu_memory_gib=cpu_memory, nvme_gib=nvme, node=node
        )
        choice = best_plan(
            model_spec, cluster, training,
            stage=stage, offload_optimizer=offload_optimizer, offload_param=offload_param, checkpointing=checkpointing,
            engine=engine, optimizer_impl=optimizer_impl, buckets=plan_buckets, sp=sp_degrees or (1,), tp=tp_degrees or (1,), tiled_mlp=tiled_mlp,
            expert_degrees=expert_degrees,
            recipe=recipe_spec, recipe_models=recipe_models(recipe_spec),
        )
        if choice.best is None:
            _note(f"no plan fits {model_spec.name} on {gpus} × {cluster.gpu.name}; nothing written (see `zeroplan estimate`)")
            raise typer.Exit(1)
        best = choice.best
        plan = best.plan
        if cpu_checkpointing and plan.checkpointing != "none":
            from dataclasses import replace

            plan = replace(plan, cpu_checkpointing=True)
        _note(
            f"chose {plan.label_for(engine)}: predicted {best.gpu.required / 1024**3:.1f} GiB per GPU, "
            f"{best.tokens_per_second:,.0f} tokens/s ({choice.fitting} of {choice.considered} plans fit)"
        )

    if engine == "fsdp":
        from zeroplan.fsdpconfig import fsdp_settings

        write_output(json.dumps(fsdp_settings(plan, training, world_size=gpus, optimizer_impl=optimizer_impl), indent=2), output)
        return
    cfg, notes = build_config_with_notes(
        plan, world_size=gpus, training=training, model=model_spec, lr=lr,
        warmup_steps=warmup_steps, total_steps=total_steps, nvme_path=nvme_path, optimizer_impl=optimizer_impl,
    )
    cluster_for_fit = None
    if model_spec is not None and stage is not None and micro_batch is not None:
        # An explicit plan is written as asked; the estimator only says whether it fits.
        cluster_for_fit = resolve_cluster(
            gpus=gpus, gpus_per_node=gpus_per_node, gpu=gpu, gpu_memory_gib=gpu_memory, cpu_memory_gib=cpu_memory, nvme_gib=nvme, node=node
        )
    findings = validate_config(cfg, world_size=gpus, model=model_spec, cluster=cluster_for_fit, training=training,
                               checkpointing=plan.checkpointing, recipe=recipe_spec)
    # The fit and the recipe's rules judge the user's plan and recipe, not the written config; ZP251 is
    # about the versions installed here (AutoEP against transformers 5): the config is written as asked
    # and the finding shown.
    fit = [f for f in findings if f.rule_id in ("ZP702", "ZP251") or f.rule_id.startswith("ZP95")]
    findings = [f for f in findings if f not in fit]
    if has_errors(findings):  # a bug in build_config, never the user's input
        raise RuntimeError("exported config fails validation: " + "; ".join(f.message for f in findings if f.severity == "error"))
    if target == "hf":
        from zeroplan.dsconfig.hf_auto import to_hf_auto, trainer_flags

        write_output(json.dumps(to_hf_auto(cfg), indent=2), output)
        _note("Hugging Face Trainer fills the \"auto\" entries; run it with: " + " ".join(trainer_flags(cfg)))
    else:
        write_output(json.dumps(cfg, indent=2), output)
    if accelerate_config is not None:
        from pathlib import Path

        from zeroplan.dsconfig.hf_auto import accelerate_yaml

        text = accelerate_yaml(str(Path(output).resolve()), num_processes=gpus, zero3_init=plan.stage == 3,
                               parallelism=accelerate_parallelism_entries(plan, seq_len=training.seq_len))
        try:
            Path(accelerate_config).write_text(text)
        except OSError as exc:
            raise SpecError(f"--accelerate-config {accelerate_config}: cannot write ({exc.strerror})") from None
        _note(f"wrote {accelerate_config}: accelerate launch --config_file {accelerate_config} train.py")
    for note in notes + trainer_layout_settings(plan) + [f"{f.rule_id}: {f.message}" for f in findings if f.severity == "warning"]:
        _note(note)
    for f in fit:
        _note(f"warning: {f.message}; {f.fix}" if f.severity == "error" else f.message)
    if recipe_spec is not None:
        from zeroplan.cli.export_trl import write_trl_values

        write_trl_values(recipe_spec, plan, training, output)
