"""``zeroplan validate CONFIG.json``: findings with rule ids, JSON paths and fixes.

Exit 0 when there are no errors, 1 when there are, 2 when the config cannot be read.
"""

from __future__ import annotations

import json
import os
from typing import Annotated, Optional

import typer

from zeroplan.cli import app
from zeroplan.cli.common import OutputOpt, check_choice_option, stdout_console, terminal_width, write_output
from zeroplan.cli.options import (
    ClusterOptions, EngineOptions, ModelOptions, PeftGroup, PlanOptions, RecipeOptions, Take, TrainingOptions, grouped,
)
from zeroplan.spec import SpecError

__all__ = ["validate", "findings_table", "print_findings_narrow"]

ValidateGpusOpt = Annotated[
    Optional[int],
    typer.Option("--gpus", help="GPUs (ranks) the job launches; default: the count the batch keys imply.", rich_help_panel="Cluster"),
]
ValidateFormatOpt = Annotated[str, typer.Option("--format", help="table | json (a list of findings).", rich_help_panel="Output")]

_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


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


HfArgOpt = Annotated[
    Optional[list[str]],
    typer.Option("--hf-arg", help="A TrainingArguments value \"auto\" resolves from, NAME=VALUE, repeatable (e.g. per_device_train_batch_size=4).", rich_help_panel="Hugging Face"),
]
MaxStepsOpt = Annotated[
    Optional[int], typer.Option("--max-steps", help="Training steps, for an \"auto\" scheduler step count.", rich_help_panel="Hugging Face")
]
ValidateSpOpt = Annotated[Optional[int], typer.Option("--sp", help="The run's sequence-parallel degree when the config does not name it (accelerate's parallelism_config).", rich_help_panel="Plan")]
ValidateTpOpt = Annotated[Optional[int], typer.Option("--tp", help="The run's AutoTP degree when the config does not name it.", rich_help_panel="Plan")]
ValidateCluster = Annotated[ClusterOptions, Take(options={"gpus": ValidateGpusOpt})]
#: The host's two questions, as estimate, export and tune take them (the engine is the config's: DeepSpeed).
ValidateEngine = Annotated[EngineOptions, Take(only=("model_save", "model_build"))]
ConfigArg = Annotated[str, typer.Argument(help="DeepSpeed JSON config to check.", show_default=False)]


def _check_model_flags(model_opts: ModelOptions, cluster_opts: ClusterOptions, peft_opts: PeftGroup, engine_opts: EngineOptions) -> None:
    """The PEFT, cluster and host flags are for the memory check, which needs a model."""
    if model_opts.given:
        return
    if peft_opts.spec().given:
        peft_opts.spec().require_model("are for the memory check; also give --model")
    c = cluster_opts
    if any(v is not None for v in (c.gpu, c.gpu_memory, c.cpu_memory, c.node, c.nvme, c.gpus_per_node)):
        raise SpecError("--gpu/--gpu-memory/--cpu-memory/--node/--nvme/--gpus-per-node are for the memory check; also give --params or --model")
    if engine_opts.model_save is not None or engine_opts.model_build is not None:
        raise SpecError("--model-save/--model-build are for the memory check; also give --params or --model")


def _render(parsed, outcome, trainer_args, *, gpus: Optional[int], max_steps: Optional[int]) -> None:
    from zeroplan.dsconfig.hf_auto import auto_keys

    findings = outcome.findings
    console = stdout_console(width=terminal_width(160))
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
    for note in outcome.notes:
        console.print(f"[dim]• {note}[/dim]")
    if auto_keys(parsed.config):
        hidden = outcome.model.hidden_size if outcome.model else None
        console.print(_auto_table(parsed.config, trainer_args, hidden_size=hidden, max_steps=max_steps))


@app.command()
@grouped
def validate(
    config: ConfigArg, cluster_opts: ValidateCluster = None, model_opts: ModelOptions = None,
    training_opts: Annotated[TrainingOptions, Take(only=("seq_len",))] = None,
    plan_opts: Annotated[PlanOptions, Take(only=("checkpointing",))] = None, peft_opts: PeftGroup = None,
    hf_arg: HfArgOpt = None, max_steps: MaxStepsOpt = None, sp: ValidateSpOpt = None, tp: ValidateTpOpt = None,
    fmt: ValidateFormatOpt = "table", output: OutputOpt = None, recipe_opts: RecipeOptions = None, engine_opts: ValidateEngine = None,
) -> None:
    """Check a DeepSpeed config before the run; with a model, also whether it fits the GPU.

    Batch arithmetic for the GPU count, ZeRO/offload combinations, precision, value types,
    unknown keys, optimizer; with a model, bucket sizes and the estimator's memory fit.

    Exit code 0 when no errors are found, 1 when some are, 2 when the config cannot be read.
    """
    from zeroplan.dsconfig import has_errors, load_config
    from zeroplan.dsconfig.validate_run import ValidateRequest, implied_world_size, run_validate

    check_choice_option("--format", fmt, ("table", "json"))
    recipe_spec = recipe_opts.resolve()
    plan_opts.check()
    engine_opts.check_host(stage=None)  # the stage is the config's: checked against it in run_validate
    gpus, seq_len = cluster_opts.gpus, training_opts.seq_len
    if gpus is not None and gpus < 1:
        raise SpecError(f"--gpus {gpus} is not valid; give at least 1")
    if seq_len < 1:
        raise SpecError(f"--seq-len {seq_len} is not valid; give a whole number >= 1")
    if output is not None and fmt != "json":
        raise SpecError("--output needs --format json (the table prints to the terminal)")
    parsed = load_config(config)
    trainer_args = parse_hf_args(hf_arg or [], world_size=gpus or implied_world_size(parsed.config))
    if max_steps is not None and max_steps < 1:
        raise SpecError(f"--max-steps {max_steps} is not valid; give a whole number >= 1")
    _check_model_flags(model_opts, cluster_opts, peft_opts, engine_opts)
    outcome = run_validate(ValidateRequest(
        parsed=parsed, gpus=gpus, seq_len=seq_len, checkpointing=plan_opts.checkpointing, sp=sp, tp=tp, recipe=recipe_spec,
        model_for=(lambda precision: model_opts.resolve(peft_opts, precision=precision)) if model_opts.given else None,
        cluster_for=cluster_opts.resolve, accelerator=os.environ.get("DS_ACCELERATOR") or None,
        model_save=engine_opts.model_save, model_build=engine_opts.model_build,
    ))
    if fmt == "json":
        write_output(json.dumps([f.as_dict() for f in outcome.findings], indent=2), output)
    else:
        _render(parsed, outcome, trainer_args, gpus=gpus, max_steps=max_steps)
    if has_errors(outcome.findings):
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
