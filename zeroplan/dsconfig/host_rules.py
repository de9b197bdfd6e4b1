"""Validation rules for host memory and NVMe: ZP9xx.

They need the model (``--params``/``--model``) and, for ZP901, the node's host RAM (``--cpu-memory``,
``--node`` or the GPU's node profile; see docs/host-memory.md). Registered in the shared registry
(:data:`zeroplan.dsconfig.rules.RULES`) when this module is imported.
"""

from __future__ import annotations

from typing import Iterator

from zeroplan.dsconfig.plan import is_whole_number
from zeroplan.dsconfig.rules import Context, Finding, _f, _fmt, rule

__all__: list[str] = []

_GIB = 1024**3
#: Pinned (page-locked) pages are never swapped out or reclaimed: past half the node's RAM the
#: page cache, the data loaders and every unpinned tensor share what is left.
_PINNED_WARN_FRACTION = 0.5


def _block(ctx: Context, name: str) -> dict | None:
    found = ctx.offload(name)
    return found[0] if found is not None else None


def _swap_settings(ctx: Context) -> tuple[int, int, int]:
    """(param buffer_count × buffer_size, param buffer_size, optimizer buffer_count) as DeepSpeed reads them
    (zero/offload_config.py defaults 5, 1e8 and 4)."""
    param = _block(ctx, "offload_param") or {}
    opt = _block(ctx, "offload_optimizer") or {}
    count = param.get("buffer_count", 5)
    size = param.get("buffer_size", 100_000_000)
    opt_count = opt.get("buffer_count", 4)
    count = int(count) if is_whole_number(count) and count >= 0 else 5
    size = int(size) if is_whole_number(size) and size >= 0 else 100_000_000
    opt_count = int(opt_count) if is_whole_number(opt_count) and opt_count >= 0 else 4
    return count * size, size, opt_count


def _pin(block: dict | None) -> bool:
    return block is not None and block.get("pin_memory", True) is not False


@rule(
    "ZP901", "warning", "Pinned offload buffers take too much of the host's RAM",
    "With pin_memory (DeepSpeed's default) the offload buffers are page-locked, and PyTorch's pinned allocator "
    "rounds each up to a power of two; past half the node's RAM nothing else can use those pages, and past all of "
    "it the ranks are killed at engine start-up.",
)
def _pinned_share(ctx: Context) -> Iterator[Finding]:
    if ctx.model is None or ctx.cluster is None or not ctx.cluster.cpu_memory_per_node_bytes:
        return
    opt, param = _block(ctx, "offload_optimizer"), _block(ctx, "offload_param")
    if not (_pin(opt) or _pin(param)):
        return
    from zeroplan.dsconfig.rules.fit import _plan_from_config
    from zeroplan.estimator import host_phases

    built, _ = _plan_from_config(ctx)
    if built is None:
        return
    plan, training = built
    elements, _, opt_count = _swap_settings(ctx)
    phases = host_phases(ctx.model, ctx.cluster, training, plan, param_swap_elements=elements, optimizer_swap_buffers=opt_count)
    step = phases.get("step")
    param_items = {"param_partition_16bit", "param_swap_buffers"}
    pinned = [k for k in phases.pinned if (k in param_items and _pin(param)) or (k not in param_items and _pin(opt))]
    per_node = step.ranks * sum(step.per_rank.get(k, 0) for k in pinned)
    ram = ctx.cluster.cpu_memory_per_node_bytes
    if per_node <= _PINNED_WARN_FRACTION * ram:
        return
    blocks = [n for n, b in (("offload_optimizer", opt), ("offload_param", param)) if _pin(b)]
    severity = "error" if per_node > ram else "warning"
    yield _f(
        "ZP901", f"zero_optimization.{blocks[0]}.pin_memory",
        f"DeepSpeed pins {per_node / _GIB:.1f} GiB per node ({step.ranks} ranks; {', '.join(pinned)}, rounded to powers of "
        f"two) of the node's {ram / _GIB:.0f} GiB ({ctx.cluster.cpu_memory_source or 'host RAM'})",
        "set \"pin_memory\": false in " + " and ".join(blocks) + " (slower host-device copies, pages can be swapped), or "
        "offload less (offload_param none, a higher stage's partition) or use more nodes",
        severity=severity,
    )


@rule(
    "ZP902", "error", "NVMe parameter swap buffer smaller than a parameter's partition",
    "ZeRO-Infinity swaps each parameter's partition through one of buffer_count buffers of buffer_size elements; "
    "DeepSpeed asserts 'More elements N than buffer size' (swap_tensor/partitioned_param_swapper.py get_buffer) "
    "the first time a larger partition is fetched.",
)
def _param_buffer_size(ctx: Context) -> Iterator[Finding]:
    param = _block(ctx, "offload_param")
    if ctx.model is None or ctx.stage != 3 or param is None or (ctx.offload("offload_param") or ({}, ""))[1] != "nvme":
        return
    from zeroplan.estimator.memory import largest_param_numel

    world = ctx.world_size or 1
    need = -(-largest_param_numel(ctx.model) // world)
    _, size, _ = _swap_settings(ctx)
    if size >= need:
        return
    yield _f(
        "ZP902", "zero_optimization.offload_param.buffer_size",
        f"buffer_size {_fmt(size)} elements < the largest parameter's partition, {_fmt(need)} elements "
        f"({_fmt(largest_param_numel(ctx.model))} / {world} ranks)",
        f"set zero_optimization.offload_param.buffer_size to at least {_fmt(need)}",
    )
