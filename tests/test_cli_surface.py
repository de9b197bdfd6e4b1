"""The command-line surface is frozen: every command, argument and flag users and docs rely on.

A flag may be added (add it here too); one that disappears or is renamed fails this test.
"""

from __future__ import annotations

import pytest
import typer.main

from zeroplan.cli import app

#: command → (positional arguments, every option spelling).
SURFACE = {
    "calibrate": ((), {
        "--deepspeed-adam", "--device", "--engine", "--gpus", "--micro-batch", "--no-engine", "--output",
        "--engine-steps", "--no-engine-steps",
        "--precision", "--quick", "--task", "--torch-adam", "-o",
    }),
    "doctor": (('logs',), {
        "--config", "--cpu-memory", "--format", "--global-batch", "--gpu", "--gpu-memory", "--gpus", "--micro-batch",
        "--model", "--optimizer", "--output", "--params", "--precision", "--seq-len", "-o",
    }),
    "estimate": ((), {
        "--adapter", "--all", "--base-quant", "--checkpointing", "--cpu-memory", "--engine", "--expandable-segments", "--format",
        "--global-batch", "--gpu", "--gpu-memory", "--gpus", "--gpus-per-node", "--grad-accum", "--lora-alpha",
        "--lora-rank", "--lora-targets", "--micro-batch", "--model", "--model-build", "--model-save", "--no-flash", "--node", "--nvme",
        "--offload-optimizer", "--offload-param", "--optimizer", "--optimizer-impl", "--output", "--params",
        "--plot", "--precision", "--seq-len", "--stage", "--top", "--trace", "--trainable-params", "-o",
        "--loss", "--buckets", "--reduce-bucket-size", "--allgather-bucket-size", "--prefetch-bucket-size",
        "--overlap-comm",
    }),
    "export": ((), {
        "--adapter", "--base-quant", "--checkpointing", "--cpu-checkpointing", "--cpu-memory", "--global-batch",
        "--gpu", "--gpu-memory", "--gpus", "--gpus-per-node", "--grad-accum", "--lora-alpha", "--lora-rank",
        "--lora-targets", "--lr", "--micro-batch", "--model", "--node", "--nvme", "--nvme-path",
        "--offload-optimizer", "--offload-param", "--optimizer", "--output", "--params", "--precision", "--seq-len",
        "--stage", "--total-steps", "--trainable-params", "--warmup-steps", "-o",
        "--optimizer-impl", "--loss", "--buckets", "--reduce-bucket-size", "--allgather-bucket-size",
        "--prefetch-bucket-size", "--overlap-comm", "--model-save", "--model-build",
    }),
    "probe": (('script',), {
        "--adapter", "--allgather-bucket-size", "--backend", "--base-quant", "--buckets", "--checkpointing",
        "--config", "--config-arg", "--format", "--gpus", "--gpus-per-node", "--grad-accum", "--launcher",
        "--lora-alpha", "--lora-rank", "--lora-targets", "--loss", "--micro-batch", "--model", "--nnodes",
        "--node-rank", "--offload-optimizer", "--offload-param", "--optimizer", "--optimizer-impl", "--output",
        "--params", "--precision", "--prefetch-bucket-size", "--rdzv-endpoint", "--rdzv-timeout",
        "--reduce-bucket-size", "--seq-len", "--stage", "--steps", "--timeout", "--torchrun-arg",
        "--trainable-params", "--verbose", "--warmup", "--workdir", "-o", "-v", "--overlap-comm", "--engine",
    }),
    "profiles": ((), {
        "--format", "--output", "-o",
    }),
    "tune": (('script', 'script_args'), {
        "--adapter", "--backend", "--base-quant", "--bucket-sizes", "--checkpointing", "--ci", "--config-arg",
        "--cpu-memory", "--emit-sbatch", "--global-batch", "--gpu", "--gpu-memory", "--gpus", "--gpus-per-node",
        "--grad-accum", "--initial", "--launcher", "--lora-alpha", "--lora-rank", "--lora-targets", "--micro-batch",
        "--model", "--nnodes", "--node", "--node-rank", "--nvme", "--nvme-path", "--offload-optimizer",
        "--offload-param", "--optimizer", "--output", "--params", "--precision", "--rdzv-endpoint", "--rdzv-timeout",
        "--resume", "--sampler", "--seed", "--seq-len", "--stage", "--steps", "--storage", "--time-budget",
        "--timeout", "--trainable-params", "--trials", "--warmup", "-o", "--engine",
        "--optimizer-impl", "--loss", "--buckets", "--reduce-bucket-size", "--allgather-bucket-size",
        "--prefetch-bucket-size", "--overlap-comm", "--ep", "--model-save", "--model-build",
    }),
    "validate": (('config',), {
        "--adapter", "--base-quant", "--checkpointing", "--cpu-memory", "--format", "--gpu", "--gpu-memory",
        "--gpus", "--gpus-per-node", "--lora-alpha", "--lora-rank", "--lora-targets", "--model", "--node", "--nvme",
        "--output", "--params", "--seq-len", "--trainable-params", "-o", "--model-save", "--model-build",
    }),
}

#: Context parallelism (zeroplan/cli/context_option.py): estimate plans it; export and tune refuse it in one line.
for _command in ("estimate", "export", "tune"):
    SURFACE[_command][1].add("--cp")

#: The recipe options (zeroplan/cli/recipe_options.py): every planning command takes them.
RECIPE_FLAGS = {"--recipe", "--generations", "--completion-len", "--vllm-gpu-memory", "--vllm-sleep", "--reference"}
for _command in ("estimate", "export", "validate", "probe", "tune"):
    SURFACE[_command][1].update(RECIPE_FLAGS)
for _command in ("estimate", "export", "validate", "probe"):
    SURFACE[_command][1].update({"--reward-model", "--critic-model"})


def _surface() -> dict:
    group = typer.main.get_command(app)
    out = {}
    for name, cmd in group.commands.items():
        flags = set()
        for param in cmd.params:
            if param.param_type_name == "option":
                flags |= set(param.opts) | set(param.secondary_opts)
        out[name] = (tuple(p.name for p in cmd.params if p.param_type_name == "argument"), flags)
    return out


def test_no_command_argument_or_flag_disappears():
    now = _surface()
    assert set(SURFACE) <= set(now), f"commands gone: {set(SURFACE) - set(now)}"
    for name, (args, flags) in SURFACE.items():
        assert now[name][0] == args, name
        assert flags - now[name][1] == set(), f"{name}: flags gone: {sorted(flags - now[name][1])}"



def test_every_command_takes_h_for_help():
    """``-h`` as well as ``--help`` on every command (only tune took ``-h`` before)."""
    from typer import _click as click

    group = typer.main.get_command(app)
    for name, cmd in group.commands.items():
        with click.Context(cmd, info_name=name, parent=click.Context(group, info_name="zeroplan", **app.info.context_settings)) as ctx:
            assert sorted(cmd.get_help_option(ctx).opts) == ["--help", "-h"], name


def _parse(command: str, args: list[str]) -> dict:
    """The values click parses for ``args`` (before the option groups are built), and the visible help."""
    from typer import _click as click

    group = typer.main.get_command(app)
    cmd = group.commands[command]
    parent = click.Context(group, info_name="zeroplan", **app.info.context_settings)
    with cmd.make_context(command, list(args), parent=parent, resilient_parsing=True) as ctx:
        return dict(ctx.params), cmd.get_help(ctx)


@pytest.mark.parametrize("command", ["probe", "tune"])
def test_engine_is_the_one_name_and_backend_its_hidden_old_spelling(command):
    from zeroplan.cli.options import EngineOptions

    new, help_text = _parse(command, ["x.py", "--engine", "fsdp"])
    old, _ = _parse(command, ["x.py", "--backend", "fsdp"])
    pick = lambda p: EngineOptions(engine=p["engine"], backend=p["backend"]).name  # noqa: E731
    assert pick(new) == pick(old) == "fsdp" and pick(_parse(command, ["x.py"])[0]) == "deepspeed"
    rows = [line.lstrip() for line in help_text.splitlines()]
    assert any(r.startswith("--engine <str>") for r in rows) and not any(r.startswith("--backend") for r in rows)


def test_calibrate_engine_steps_and_its_old_spelling():
    """``--engine`` is deepspeed|fsdp elsewhere; calibrate's switch is ``--engine-steps``, ``--no-engine`` still parses."""
    default, help_text = _parse("calibrate", [])
    assert (default["engine_steps"], default["engine"]) == (True, None)
    assert _parse("calibrate", ["--no-engine-steps"])[0]["engine_steps"] is False
    assert _parse("calibrate", ["--no-engine"])[0]["engine"] is False
    assert "--engine-steps / --no-engine-steps" in help_text and "--engine / --no-engine" not in help_text


def test_engine_means_deepspeed_or_fsdp_on_every_command_that_plans_or_runs_one():
    """One name per concept: ``--engine`` takes deepspeed|fsdp wherever it appears except calibrate
    (a hidden old switch there), and ``--backend`` is never shown."""
    group = typer.main.get_command(app)
    with_engine = set()
    for name, cmd in group.commands.items():
        for param in cmd.params:
            if "--engine" in param.opts and name != "calibrate":
                assert not param.is_flag and param.default == "deepspeed" and not param.hidden, name
                with_engine.add(name)
            if "--backend" in param.opts or "--engine" in getattr(param, "opts", ()) and name == "calibrate":
                assert param.hidden, name
    assert with_engine == {"estimate", "export", "probe", "tune"}


def test_one_name_per_concept_across_commands():
    """An option spelling means the same parameter on every command, and a parameter has the same
    spellings everywhere; the one exception is calibrate's hidden old ``--engine/--no-engine`` switch."""
    from collections import defaultdict

    group = typer.main.get_command(app)
    names, spellings = defaultdict(set), defaultdict(set)
    for command, cmd in group.commands.items():
        for param in cmd.params:
            if param.param_type_name != "option" or (command, param.name) == ("calibrate", "engine"):
                continue
            spellings[param.name].add((tuple(param.opts), tuple(param.secondary_opts)))
            for opt in param.opts:
                names[opt].add(param.name)
    assert {o: n for o, n in names.items() if len(n) > 1} == {}
    assert {n: s for n, s in spellings.items() if len(s) > 1} == {}
