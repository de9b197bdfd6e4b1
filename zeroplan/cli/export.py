"""``zeroplan export``: a DeepSpeed JSON config for one plan (stdout, or ``-o FILE`` atomically).

With ``--stage`` and ``--micro-batch`` the plan is taken as given (with a model, a note on stderr
says whether the estimator predicts it fits). Without them a model
(``--params``/``--model``) is needed and export takes the fastest plan the estimator says fits,
within whatever plan options were given.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Optional

import typer

from zeroplan.cli import app
from zeroplan.cli.common import OutputOpt, check_choice_option, write_output
from zeroplan.cli.expert_option import EpOpt
from zeroplan.cli.context_option import CpRefusedOpt, refuse_context_parallel
from zeroplan.cli.options import (
    ClusterOptions, EngineOptions, ModelOptions, PeftGroup, PlanOptions, RecipeOptions, Take, TrainingOptions, grouped,
)
from zeroplan.spec import RUNNABLE_ENGINES, SpecError, engine_facts

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


ForOpt = Annotated[
    str, typer.Option("--for", help='deepspeed | hf: hf writes "auto" wherever Hugging Face Trainer fills the value.', rich_help_panel="Output")
]
AccelerateOpt = Annotated[
    Optional[str], typer.Option("--accelerate-config", help="Also write an accelerate YAML that runs DeepSpeed with the exported file (needs --output).", rich_help_panel="Output")
]
#: export's ``--engine`` says what each engine's file is.
ExportEngine = Annotated[EngineOptions, Take(
    only=("optimizer_impl", "loss", "buckets", "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "overlap_comm", "engine",
          "model_save", "model_build"),
    options={"engine": Annotated[str, typer.Option("--engine", help="deepspeed (a DeepSpeed JSON config) | fsdp (PyTorch DDP/FSDP2 settings as JSON: fully_shard, mixed precision, offload).", rich_help_panel="Output")]},
)]


def _check_targets(target: str, engine: str, accelerate_config: Optional[str], output) -> None:
    check_choice_option("--for", target, ("deepspeed", "hf"))
    check_choice_option("--engine", engine, RUNNABLE_ENGINES)
    if engine_facts(engine).torch and (target != "deepspeed" or accelerate_config is not None):
        raise SpecError("--engine fsdp writes PyTorch settings; --for hf and --accelerate-config are for DeepSpeed configs")


def _write(outcome, request, *, output, accelerate_config: Optional[str]) -> None:
    """The document, the accelerate YAML and the TRL values; every note on stderr."""
    write_output(json.dumps(outcome.document, indent=2), output)
    if outcome.written_note:
        _note(outcome.written_note)
    if outcome.accelerate_yaml is not None:
        try:
            Path(accelerate_config).write_text(outcome.accelerate_yaml)
        except OSError as exc:
            raise SpecError(f"--accelerate-config {accelerate_config}: cannot write ({exc.strerror})") from None
        _note(f"wrote {accelerate_config}: accelerate launch --config_file {accelerate_config} train.py")
    for note in outcome.notes:
        _note(note)
    if request.recipe is not None:
        from zeroplan.cli.export_trl import write_trl_values

        write_trl_values(request.recipe, outcome.plan, request.training, output)


@app.command()
@grouped
def export(
    model_opts: ModelOptions, cluster_opts: ClusterOptions, training_opts: TrainingOptions,
    plan_opts: Annotated[PlanOptions, Take(only=("stage", "offload_optimizer", "offload_param", "checkpointing", "sp", "tp", "tiled_mlp", "cp"),
                                           options={"cp": CpRefusedOpt})],
    cpu_checkpointing: CpuCkptOpt = False, nvme_path: NvmePathOpt = None, lr: LrOpt = 1e-4, warmup_steps: WarmupOpt = 100,
    total_steps: TotalStepsOpt = None, peft_opts: PeftGroup = None, engine_opts: ExportEngine = None, ep: EpOpt = None,
    target: ForOpt = "deepspeed", accelerate_config: AccelerateOpt = None, output: OutputOpt = None, recipe_opts: RecipeOptions = None,
) -> None:
    """Write a DeepSpeed config for a plan (or the fastest plan that fits) that passes validate.

    Consistent batch keys, integer bucket sizes (from the model's hidden size when given),
    offload blocks only where DeepSpeed honours them, optimizer and scheduler blocks.

    Exit code 0 on success, 1 when no plan fits (nothing written), 2 on bad input.
    """
    from zeroplan.dsconfig.export import ExportRequest, run_export
    from zeroplan.estimator.expert_parallel import parse_expert_degrees
    from zeroplan.profiles.recipe_models import recipe_models

    plan_opts.check()
    refuse_context_parallel("export", plan_opts.context_degrees())
    recipe_spec = recipe_opts.resolve()
    if recipe_spec is not None:
        recipe_spec.check_sequence(training_opts.seq_len)
    engine = engine_opts.name
    _check_targets(target, engine, accelerate_config, output)
    plan_buckets = engine_opts.resolve(plan_opts)
    if accelerate_config is not None and output is None:
        raise SpecError("--accelerate-config points accelerate at the exported file: also give --output ds.json")
    gpus = cluster_opts.world(runs_here=False)
    expert_degrees = parse_expert_degrees(ep, engine=engine)
    training = training_opts.resolve()
    if engine_opts.loss is not None:
        training = replace(training, loss=engine_opts.loss)
    model_spec = model_opts.resolve(peft_opts, precision=training_opts.precision) if model_opts.given else None
    if model_spec is None:
        peft_opts.spec().require_model("need a model: --model NAME or config.json")
    sp_degrees, tp_degrees = plan_opts.layout()
    layout_asked = any(d > 1 for d in (*(sp_degrees or ()), *(tp_degrees or ())))
    request = ExportRequest(
        training=training, gpus=gpus, model=model_spec,
        cluster=cluster_opts.resolve(gpus) if model_spec is not None or layout_asked else None,
        stage=plan_opts.stage, offload_optimizer=plan_opts.offload_optimizer, offload_param=plan_opts.offload_param,
        checkpointing=plan_opts.checkpointing, micro_batch=training_opts.micro_batch, sp=sp_degrees, tp=tp_degrees,
        tiled_mlp=plan_opts.tiled_mlp, expert_degrees=expert_degrees, cpu_checkpointing=cpu_checkpointing, engine=engine,
        optimizer_impl=engine_opts.optimizer_impl, buckets=plan_buckets, lr=lr, warmup_steps=warmup_steps, total_steps=total_steps,
        nvme_path=nvme_path, target=target, recipe=recipe_spec, recipe_models=recipe_models(recipe_spec) if recipe_spec is not None else {},
        accelerate_config_for=str(Path(output).resolve()) if accelerate_config is not None else None, model_save=engine_opts.model_save,
        model_build=engine_opts.model_build,
    )
    outcome = run_export(request)
    if outcome.chose:
        _note(outcome.chose)
    if outcome.plan is None:
        raise typer.Exit(1)
    if engine_facts(engine).torch:
        write_output(json.dumps(outcome.document, indent=2), output)
        return
    _write(outcome, request, output=output, accelerate_config=accelerate_config)
