"""The command-line surface is frozen: every command, argument and flag users and docs rely on.

A flag may be added (add it here too); one that disappears or is renamed fails this test.
"""

from __future__ import annotations

import typer.main

from zeroplan.cli import app

#: command → (positional arguments, every option spelling).
SURFACE = {
    "calibrate": ((), {
        "--deepspeed-adam", "--device", "--engine", "--gpus", "--micro-batch", "--no-engine", "--output",
        "--precision", "--quick", "--task", "--torch-adam", "-o",
    }),
    "doctor": (('logs',), {
        "--config", "--cpu-memory", "--format", "--global-batch", "--gpu", "--gpu-memory", "--gpus", "--micro-batch",
        "--model", "--optimizer", "--output", "--params", "--precision", "--seq-len", "-o",
    }),
    "estimate": ((), {
        "--adapter", "--all", "--base-quant", "--checkpointing", "--cpu-memory", "--engine", "--expandable-segments", "--format",
        "--global-batch", "--gpu", "--gpu-memory", "--gpus", "--gpus-per-node", "--grad-accum", "--lora-alpha",
        "--lora-rank", "--lora-targets", "--micro-batch", "--model", "--model-build", "--no-flash", "--node", "--nvme",
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
        "--prefetch-bucket-size", "--overlap-comm",
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
        "--prefetch-bucket-size", "--overlap-comm", "--ep",
    }),
    "validate": (('config',), {
        "--adapter", "--base-quant", "--checkpointing", "--cpu-memory", "--format", "--gpu", "--gpu-memory",
        "--gpus", "--gpus-per-node", "--lora-alpha", "--lora-rank", "--lora-targets", "--model", "--node", "--nvme",
        "--output", "--params", "--seq-len", "--trainable-params", "-o",
    }),
}

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
