"""``zeroplan validate CONFIG.json``: findings with rule ids, JSON paths and fixes.

Exit 0 when there are no errors, 1 when there are, 2 when the config cannot be read.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Optional

import typer

from zeroplan.cli.recipe_options import (
    CompletionLenOpt, CriticModelOpt, GenerationsOpt, RecipeOpt, ReferenceOpt, RewardModelOpt, VllmGpuMemoryOpt, VllmSleepOpt, resolve_recipe,
)
from zeroplan.cli import app
from zeroplan.cli.common import (
    AdapterOpt,
    BaseQuantOpt,
    LoraAlphaOpt,
    LoraRankOpt,
    LoraTargetsOpt,
    TrainableParamsOpt,
    CheckpointingOpt,
    CpuMemoryOpt,
    GpuMemoryOpt,
    GpuOpt,
    GpusPerNodeOpt,
    ModelOpt,
    NodeOpt,
    NvmeOpt,
    OutputOpt,
    ParamsOpt,
    PeftOptions,
    SeqLenOpt,
    check_choice_option,
    check_plan_options,
    resolve_cluster,
    resolve_model,
    terminal_width,
    write_output,
)
from zeroplan.spec import SpecError

__all__ = ["validate", "findings_table", "print_findings_narrow"]

ValidateGpusOpt = Annotated[
    Optional[int],
    typer.Option("--gpus", help="GPUs (ranks) the job launches; default: the count the batch keys imply.", rich_help_panel="Cluster"),
]
ValidateFormatOpt = Annotated[str, typer.Option("--format", help="table | json (a list of findings).", rich_help_panel="Output")]

_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


def _implied_world_size(cfg: dict) -> int | None:
    """GPU count the three batch keys are consistent with, if they are whole numbers: the batch
    world times ``sequence_parallel_size`` (DeepSpeed's batch assertion divides the world by it)."""
    values = [cfg.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return None
    tb, mb, ga = values
    sp = cfg.get("sequence_parallel_size")
    sp = sp if isinstance(sp, int) and not isinstance(sp, bool) and sp > 1 else 1
    return tb // (mb * ga) * sp if tb % (mb * ga) == 0 else None


def findings_table(findings, *, title: str):
    """A rich Table of findings (severity, rule, path, message, fix)."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", show_lines=False)
    for col in ("severity", "rule", "path", "problem", "fix"):
        table.add_column(col, overflow="fold", no_wrap=col in ("severity", "rule"))
    for f in findings:
        table.add_row(f.severity, f.rule_id, f.path or "(config)", f.message, f.fix, style=_STYLE[f.severity])
    return table


#: Below this width the five-column table breaks paths and fixes mid-word: one block per finding.
NARROW_COLUMNS = 110


def print_findings_narrow(console, findings) -> None:
    """Each finding as ``severity rule path`` then its problem and fix, indented (narrow terminals)."""
    from rich.padding import Padding
    from rich.text import Text

    for f in findings:
        console.print(Text.assemble((f"{f.severity} {f.rule_id}", _STYLE[f.severity]), f" {f.path or '(config)'}"))
        console.print(Padding(Text(f.message), (0, 0, 0, 2)))
        console.print(Padding(Text(f"fix: {f.fix}", style="dim"), (0, 0, 0, 2)))


@app.command()
def validate(
    config: Annotated[str, typer.Argument(help="DeepSpeed JSON config to check.", show_default=False)],
    gpus: ValidateGpusOpt = None,
    params: ParamsOpt = None,
    model: ModelOpt = None,
    gpus_per_node: GpusPerNodeOpt = None,
    gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    cpu_memory: CpuMemoryOpt = None,
    node: NodeOpt = None,
    nvme: NvmeOpt = None,
    seq_len: SeqLenOpt = 2048,
    checkpointing: CheckpointingOpt = None,
    lora_rank: LoraRankOpt = None,
    lora_targets: LoraTargetsOpt = None,
    lora_alpha: LoraAlphaOpt = None,
    adapter: AdapterOpt = None,
    trainable_params: TrainableParamsOpt = None,
    base_quant: BaseQuantOpt = None,
    hf_arg: Annotated[
        Optional[list[str]],
        typer.Option("--hf-arg", help="A TrainingArguments value \"auto\" resolves from, NAME=VALUE, repeatable (e.g. per_device_train_batch_size=4).", rich_help_panel="Hugging Face"),
    ] = None,
    max_steps: Annotated[
        Optional[int], typer.Option("--max-steps", help="Training steps, for an \"auto\" scheduler step count.", rich_help_panel="Hugging Face")
    ] = None,
    sp: Annotated[Optional[int], typer.Option("--sp", help="The run's sequence-parallel degree when the config does not name it (accelerate's parallelism_config).", rich_help_panel="Plan")] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", help="The run's AutoTP degree when the config does not name it.", rich_help_panel="Plan")] = None,
    fmt: ValidateFormatOpt = "table",
    output: OutputOpt = None,
    recipe: RecipeOpt = None, generations: GenerationsOpt = None, completion_len: CompletionLenOpt = None,
    vllm_gpu_memory: VllmGpuMemoryOpt = None, vllm_sleep: VllmSleepOpt = False, reference: ReferenceOpt = None,
    reward_model: RewardModelOpt = None, critic_model: CriticModelOpt = None,
) -> None:
    """Check a DeepSpeed config before the run; with a model, also whether it fits the GPU.

    Batch arithmetic for the GPU count, ZeRO/offload combinations, precision, value types,
    unknown keys, optimizer; with a model, bucket sizes and the estimator's memory fit.

    Exit code 0 when no errors are found, 1 when some are, 2 when the config cannot be read.
    """
    from zeroplan.dsconfig import has_errors, load_config, validate_config
    from zeroplan.spec import TrainingSpec

    check_choice_option("--format", fmt, ("table", "json"))
    recipe_spec = resolve_recipe(recipe, generations=generations, completion_len=completion_len, vllm_gpu_memory=vllm_gpu_memory,
                                 vllm_sleep=vllm_sleep, reference=reference, reward_model=reward_model, critic_model=critic_model)
    check_plan_options(stage=None, offload_optimizer=None, offload_param=None, checkpointing=checkpointing)
    if gpus is not None and gpus < 1:
        raise SpecError(f"--gpus {gpus} is not valid; give at least 1")
    if seq_len < 1:
        raise SpecError(f"--seq-len {seq_len} is not valid; give a whole number >= 1")
    if output is not None and fmt != "json":
        raise SpecError("--output needs --format json (the table prints to the terminal)")
    parsed = load_config(config)
    trainer_args = parse_hf_args(hf_arg or [], world_size=gpus or _implied_world_size(parsed.config))
    if max_steps is not None and max_steps < 1:
        raise SpecError(f"--max-steps {max_steps} is not valid; give a whole number >= 1")

    peft = PeftOptions(lora_rank, lora_targets, lora_alpha, adapter, trainable_params, base_quant)
    model_spec = cluster = None
    notes: list[str] = []
    if params is not None or model is not None:
        # The config's precision decides whether a quantized base is allowed (it needs bf16/fp16).
        precision = "bf16" if (parsed.config.get("bf16") or {}).get("enabled") else (
            "fp16" if (parsed.config.get("fp16") or {}).get("enabled") else "fp32")
        model_spec = peft.apply(resolve_model(params, model), model, precision=precision)
        cluster_gpus = gpus or _implied_world_size(parsed.config)
        if cluster_gpus is None:
            notes.append("memory fit not checked: give --gpus N (the batch keys do not fix a GPU count)")
        else:
            cluster = resolve_cluster(
                gpus=cluster_gpus, gpus_per_node=gpus_per_node, gpu=gpu, gpu_memory_gib=gpu_memory,
                cpu_memory_gib=cpu_memory, nvme_gib=nvme, node=node,
            )
            notes.extend(cluster.notes)
            if gpus is None:
                notes.append(f"fit checked on {cluster_gpus} GPUs, the count the batch keys imply (set --gpus)")
    elif peft.given:
        peft.require_model("are for the memory check; also give --model")
    elif any(v is not None for v in (gpu, gpu_memory, cpu_memory, node, nvme, gpus_per_node)):
        raise SpecError("--gpu/--gpu-memory/--cpu-memory/--node/--nvme/--gpus-per-node are for the memory check; also give --params or --model")

    from zeroplan.dsconfig.layout_keys import with_layout

    for name, value in (("--sp", sp), ("--tp", tp)):
        if value is not None and value < 1:
            raise SpecError(f"{name} {value} is not valid; give a degree >= 1")
    findings = validate_config(
        with_layout(parsed.config, sp=sp, tp=tp),
        world_size=gpus,
        model=model_spec,
        cluster=cluster,
        training=TrainingSpec(seq_len=seq_len),
        checkpointing=checkpointing,
        duplicate_keys=parsed.duplicate_keys,
        syntax=parsed.syntax,
        # The CUDA-only features' rules (ZP208-ZP211) need the accelerator the job will run on.
        accelerator=os.environ.get("DS_ACCELERATOR") or None,
        recipe=recipe_spec,
    )
    if fmt == "json":
        write_output(json.dumps([f.as_dict() for f in findings], indent=2), output)
    else:
        from rich.console import Console

        console = Console(width=terminal_width(160))
        counts = {s: sum(f.severity == s for f in findings) for s in ("error", "warning", "info")}
        summary = ", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items())
        world = f"{gpus} GPUs" if gpus else "GPU count not given"
        if findings and console.width < NARROW_COLUMNS:
            console.print(f"{parsed.source} ({world}): {summary}", markup=False, highlight=False)
            print_findings_narrow(console, findings)
        elif findings:
            console.print(findings_table(findings, title=f"{parsed.source} ({world}): {summary}"))
        else:
            console.print(f"{parsed.source} ({world}): no problems found")
        for note in notes:
            console.print(f"[dim]• {note}[/dim]")
        from zeroplan.dsconfig.hf_auto import auto_keys

        if auto_keys(parsed.config):
            console.print(_auto_table(parsed.config, trainer_args, hidden_size=model_spec.hidden_size if model_spec else None, max_steps=max_steps))
    if has_errors(findings):
        raise typer.Exit(1)


def parse_hf_args(items: list[str], *, world_size: int | None):
    """``--hf-arg NAME=VALUE`` → :class:`~zeroplan.dsconfig.hf_auto.TrainerArgs` (one line naming a bad one)."""
    import dataclasses

    from zeroplan.dsconfig.hf_auto import TrainerArgs

    fields = {f.name: f for f in dataclasses.fields(TrainerArgs)}
    values: dict = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().lstrip("-")
        if not sep or name not in fields or name == "world_size":
            valid = ", ".join(n for n in fields if n != "world_size")
            raise SpecError(f"--hf-arg {item!r}: give NAME=VALUE with NAME one of {valid}")
        default = fields[name].default
        try:
            if isinstance(default, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                values[name] = text.lower() in ("true", "1")
            elif isinstance(default, int) and not isinstance(default, float):
                values[name] = int(text)
            else:
                values[name] = float(text)
        except ValueError:
            raise SpecError(f"--hf-arg {item!r}: {text!r} is not a valid {type(default).__name__}") from None
    return TrainerArgs(world_size=world_size or 1, **values)


def _auto_table(config: dict, trainer_args, *, hidden_size: int | None, max_steps: int | None):
    """What each "auto" becomes under Hugging Face Trainer (zeroplan.dsconfig.hf_auto)."""
    from rich.table import Table

    from zeroplan.dsconfig.hf_auto import resolve_hf_auto

    resolved = resolve_hf_auto(config, trainer_args, hidden_size=hidden_size, num_training_steps=max_steps)
    title = (f'"auto" under Hugging Face Trainer on {trainer_args.world_size} ranks '
             "(TrainingArguments defaults unless --hf-arg; hidden size from --model)")
    table = Table(title=title, title_justify="left")
    table.add_column("key")
    table.add_column("resolves to", justify="right")
    table.add_column("from")
    for v in resolved.values:
        table.add_row(v.key, "[red]unresolved[/]" if not v.resolved else str(v.value), v.source)
    for line in resolved.mismatches:
        table.add_row("[red]mismatch[/]", "", line.removeprefix("- "))
    return table
