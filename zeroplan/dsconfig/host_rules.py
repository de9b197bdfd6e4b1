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


# -- NVMe: the ``aio`` block (deepspeed/runtime/swap_tensor/aio_config.py, constants.py) ----------

#: DeepSpeed's ``aio`` defaults (swap_tensor/constants.py).
_AIO_DEFAULTS = {"block_size": 1_048_576, "queue_depth": 8, "intra_op_parallelism": 1}
#: swap_tensor/utils.py ``MIN_AIO_BYTES``: tensors below max(this, block_size) are not swapped.
_MIN_AIO_BYTES = 1024**2
#: O_DIRECT transfers must start at multiples of the device's logical block size (open(2), NOTES:
#: 512 bytes on Linux 2.6+ for most devices); DeepSpeed opens swap files with O_DIRECT and
#: splits each transfer at multiples of block_size (csrc/aio/common/deepspeed_aio_utils.cpp).
_O_DIRECT_ALIGN = 512
#: Linux's default ``fs.aio-max-nr`` (Documentation/admin-guide/sysctl/fs.rst: io_setup fails
#: with EAGAIN once the events of all live aio contexts would exceed it).
_AIO_MAX_NR_DEFAULT = 65536


def _aio(ctx: Context) -> dict:
    block = ctx.cfg.get("aio")
    return block if isinstance(block, dict) else {}


def _nvme_users(ctx: Context) -> tuple[bool, bool]:
    """(parameters swapped to NVMe, optimizer states swapped to NVMe)."""
    param = ctx.offload("offload_param")
    opt = ctx.offload("offload_optimizer")
    return (ctx.stage == 3 and param is not None and param[1] == "nvme"), (opt is not None and opt[1] == "nvme")


@rule(
    "ZP903", "error", "aio settings DeepSpeed's NVMe swapper cannot use",
    "DeepSpeed reads aio.block_size, queue_depth and intra_op_parallelism without checking them "
    "(swap_tensor/aio_config.py): swap files are opened with O_DIRECT, whose transfers must start at "
    "multiples of 512 bytes, and each transfer is split at multiples of block_size; every thread of every "
    "aio handle calls io_setup(queue_depth), which fails with EAGAIN past the kernel's fs.aio-max-nr "
    "(65536 by default) events on the node, and DeepSpeed ignores that failure (deepspeed_aio_types.cpp).",
)
def _aio_values(ctx: Context) -> Iterator[Finding]:
    params_nvme, opt_nvme = _nvme_users(ctx)
    aio = _aio(ctx)
    if not (params_nvme or opt_nvme) or not aio:
        return
    values = {}
    for key, default in _AIO_DEFAULTS.items():
        value = aio.get(key, default)
        if not (is_whole_number(value) and value >= 1):
            yield _f("ZP903", f"aio.{key}", f"{key} {value!r} is not a positive whole number",
                     f"set aio.{key} to a positive integer (DeepSpeed's default is {_fmt(default)})")
            return
        values[key] = int(value)
    if values["block_size"] % _O_DIRECT_ALIGN:
        yield _f("ZP903", "aio.block_size", f"block_size {_fmt(values['block_size'])} bytes is not a multiple of 512: "
                 "O_DIRECT reads and writes past the first block start unaligned and fail (EINVAL)",
                 "use a power of two such as 1048576 (DeepSpeed's default) or 131072")
    # Handles per rank: two for parameters (partitioned_param_swapper.py: read and write), one for
    # the optimizer (partitioned_optimizer_swapper.py), two when its swaps are pipelined.
    opt_block = _block(ctx, "offload_optimizer") or {}
    pipelined = bool(opt_block.get("pipeline_read") or opt_block.get("pipeline_write"))
    handles = (2 if params_nvme else 0) + ((2 if pipelined else 1) if opt_nvme else 0)
    ranks = ctx.cluster.gpus_in_node if ctx.cluster is not None else 8
    events = ranks * handles * values["intra_op_parallelism"] * values["queue_depth"]
    if events > _AIO_MAX_NR_DEFAULT:
        yield _f("ZP903", "aio.queue_depth",
                 f"{ranks} ranks × {handles} aio handles × {values['intra_op_parallelism']} threads × queue_depth "
                 f"{values['queue_depth']} = {_fmt(events)} aio events per node > 65,536 (Linux's default fs.aio-max-nr): "
                 "io_setup fails and DeepSpeed's swaps with it",
                 f"lower aio.queue_depth to at most {_fmt(_AIO_MAX_NR_DEFAULT // (ranks * handles * values['intra_op_parallelism']))}, "
                 "or raise fs.aio-max-nr on every node (sysctl -w fs.aio-max-nr=…)")


def _param_tensors(model) -> list[tuple[str, int, int]]:
    """(name, elements, count in the model) of a decoder's parameter tensors, norms left out
    (below DeepSpeed's persistence threshold they stay on the device)."""
    h, f = model.hidden_size, model.ffn_size
    kv = h * model.num_kv_heads // max(model.num_heads, 1)
    per_layer = [("attention q/o", h * h, 2), ("attention k/v", h * kv, 2), ("mlp", h * f, 3 if model.gated_mlp else 2)]
    out = [(name, numel, count * model.num_layers) for name, numel, count in per_layer]
    out.append(("embedding", model.vocab_size * h, 1 if model.tied_embeddings else 2))
    return out


@rule(
    "ZP904", "warning", "aio.block_size keeps NVMe-offloaded parameters in host memory",
    "ZeRO-Infinity swaps a parameter's partition to NVMe only if it holds at least max(1 MiB, aio.block_size) "
    "bytes (partitioned_param_swapper.py swappable_tensor, partition_parameters.py): smaller partitions stay in "
    "host memory, pinned with pin_memory. A large block_size, or many ranks, silently turns an NVMe plan into a "
    "CPU-offload plan for those parameters.",
)
def _aio_block_keeps_params(ctx: Context) -> Iterator[Finding]:
    params_nvme, _ = _nvme_users(ctx)
    if not params_nvme or ctx.model is None:
        return
    block_size = _aio(ctx).get("block_size", _AIO_DEFAULTS["block_size"])
    if not (is_whole_number(block_size) and block_size >= 1):
        return  # ZP903
    threshold = max(_MIN_AIO_BYTES, int(block_size))
    world = ctx.world_size or 1
    p = 4 if ctx.training is not None and ctx.training.precision == "fp32" else 2
    persistence = _num(ctx.zero.get("stage3_param_persistence_threshold"), 100_000)
    kept = [(name, numel, count) for name, numel, count in _param_tensors(ctx.model)
            if numel > persistence and p * -(-numel // world) < threshold]
    if not kept:
        return
    ranks = ctx.cluster.gpus_in_node if ctx.cluster is not None else 1
    per_rank = sum(p * -(-numel // world) * count for _, numel, count in kept)
    per_node = ranks * per_rank
    ram = ctx.cluster.cpu_memory_per_node_bytes if ctx.cluster is not None else 0
    severity = "error" if ram and per_node > ram else "warning"
    names = ", ".join(name for name, _, _ in kept)
    yield _f(
        "ZP904", "aio.block_size",
        f"partitions below {_fmt(threshold)} bytes are not swapped: {names} ({world} ranks) stay in host memory, "
        f"{per_node / _GIB:.2f} GiB per node ({ranks} ranks)" + (f" of the node's {ram / _GIB:.0f} GiB" if ram else ""),
        "keep aio.block_size at 1048576 (the swap threshold is max(1 MiB, block_size)), or offload_param to cpu "
        "knowing these stay on the host",
        severity=severity,
    )


def _num(value, default: int) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else default
