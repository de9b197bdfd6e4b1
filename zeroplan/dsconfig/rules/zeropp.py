"""Validation rules ZP24x: ZeRO++ (arXiv 2306.10209) keys — hpZ (``zero_hpz_partition_size``),
qwZ (``zero_quantized_weights``), qgZ (``zero_quantized_gradients``) — against what DeepSpeed 0.19
does with them (runtime/zero/stage3.py, partition_parameters.py, utils/groups.py)."""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig.plan import is_whole_number
from zeroplan.dsconfig.rules import Context, Finding, _f, rule

_ZPP_KEYS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")


def _hpz(ctx: Context) -> int:
    value = ctx.zero.get("zero_hpz_partition_size", 1)
    return int(value) if is_whole_number(value) else 1


def _on(ctx: Context) -> list[str]:
    """The ZeRO++ options the config turns on."""
    on = []
    if _hpz(ctx) > 1:
        on.append(f"zero_hpz_partition_size={_hpz(ctx)}")
    for key in ("zero_quantized_weights", "zero_quantized_gradients"):
        if ctx.zero.get(key) is True:
            on.append(key)
    return on


@rule(
    "ZP240", "error", "ZeRO++ below stage 3",
    "hpZ, qwZ and qgZ live in the ZeRO-3 engine (stage3.py, partition_parameters.py); at stages 0–2 DeepSpeed "
    "ignores them, so the memory and traffic you planned for never happen.",
)
def _below_stage3(ctx: Context) -> Iterator[Finding]:
    on = _on(ctx)
    if not on or ctx.stage in (3, None):
        return
    yield _f("ZP240", "zero_optimization", f"{', '.join(on)} has no effect at ZeRO stage {ctx.stage}: ZeRO++ is a ZeRO-3 feature",
             "set zero_optimization.stage to 3, or remove the ZeRO++ keys")


@rule(
    "ZP241", "error", "hpZ partition size does not divide the ranks",
    "DeepSpeed groups zero_hpz_partition_size consecutive ranks (utils/groups.py "
    "_create_zero_param_parallel_group) and asserts the world size divides by it at engine start.",
)
def _hpz_divides_world(ctx: Context) -> Iterator[Finding]:
    h = _hpz(ctx)
    if h <= 1 or ctx.world_size is None or ctx.stage != 3:
        return
    if ctx.world_size % min(h, ctx.world_size):
        yield _f("ZP241", "zero_optimization.zero_hpz_partition_size",
                 f"zero_hpz_partition_size {h} does not divide the {ctx.world_size} ranks; DeepSpeed fails at engine start",
                 "set it to the GPUs per node (or a divisor of it)")


@rule(
    "ZP242", "warning", "hpZ group spans nodes",
    "hpZ keeps its secondary partition on zero_hpz_partition_size consecutive ranks so that the backward "
    "all-gather stays inside a node (ZeRO++ §3.2); a size that is not a divisor of the GPUs per node puts the "
    "group across nodes and the backward gather back on the network.",
)
def _hpz_within_node(ctx: Context) -> Iterator[Finding]:
    h = _hpz(ctx)
    if h <= 1 or ctx.cluster is None or ctx.stage != 3:
        return
    per_node = ctx.cluster.gpus_in_node
    if per_node % h:
        yield _f("ZP242", "zero_optimization.zero_hpz_partition_size",
                 f"zero_hpz_partition_size {h} does not divide the {per_node} GPUs per node: the secondary partition spans nodes",
                 f"set it to {per_node} (the GPUs per node) or a divisor of it")


@rule(
    "ZP243", "warning", "hpZ or qgZ on one node",
    "On one node there is no inter-node traffic to save: DeepSpeed runs qgZ's quantized all-to-all only when "
    "world_size // device_count > 1 (stage3.py) and otherwise the plain reduce-scatter, and hpZ's secondary "
    "partition then only costs memory (ZeRO++ §3.2).",
)
def _one_node(ctx: Context) -> Iterator[Finding]:
    if ctx.cluster is None or ctx.cluster.nodes > 1 or ctx.stage != 3:
        return
    if _hpz(ctx) > 1:
        yield _f("ZP243", "zero_optimization.zero_hpz_partition_size",
                 f"zero_hpz_partition_size {_hpz(ctx)} on one node: a secondary weight copy with no network traffic to save",
                 "remove zero_hpz_partition_size (set it to 1) on a single node")
    if ctx.zero.get("zero_quantized_gradients") is True:
        yield _f("ZP243", "zero_optimization.zero_quantized_gradients",
                 "zero_quantized_gradients on one node: DeepSpeed falls back to the plain reduce-scatter",
                 "remove zero_quantized_gradients on a single node")


@rule(
    "ZP244", "error", "qgZ without reduce_scatter",
    "qgZ replaces the gradient reduce-scatter with a quantized all-to-all; DeepSpeed asserts reduce_scatter is "
    "on when it is enabled (stage3.py: \"when enable all_to_all_reduce, reduce_scatter should also be enabled\").",
)
def _qgz_reduce_scatter(ctx: Context) -> Iterator[Finding]:
    if ctx.zero.get("zero_quantized_gradients") is True and ctx.zero.get("reduce_scatter") is False and ctx.stage == 3:
        yield _f("ZP244", "zero_optimization.reduce_scatter", "zero_quantized_gradients with reduce_scatter false: DeepSpeed's assertion fails at engine start",
                 "set zero_optimization.reduce_scatter to true (its default)")
