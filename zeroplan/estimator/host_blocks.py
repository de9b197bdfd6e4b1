"""Host buffers built of pinned blocks and per-tensor buffers (pure arithmetic, stdlib only).

PyTorch's pinned host allocator rounds every block up to a power of two (``ATen/core/CachingHostAllocator.h``
line 305, ``c10::llvm::PowerOf2Ceil``) and caches freed blocks for reuse by size; DeepSpeed pins some of its
offload buffers one per parameter (ZeRO-3's parameter partitions, ZeRO-2's gradient-accumulation buffers).
:mod:`zeroplan.estimator.host` itemizes the phases with these.
"""

from __future__ import annotations

from functools import lru_cache

__all__ = ["offload_accumulation_bytes", "pinned_bytes", "reuse_cached_blocks", "zero3_pinned_param_blocks"]


def pinned_bytes(nbytes: int) -> int:
    """Host bytes a pinned (page-locked) buffer of ``nbytes`` holds: the next power of two
    (PyTorch CachingHostAllocator, ``PowerOf2Ceil``)."""
    if nbytes <= 0:
        return 0
    return 1 << (nbytes - 1).bit_length()


def offload_accumulation_bytes(sizes: tuple[int, ...], *, world_size: int, bytes_per_param: int, pinned: bool) -> int:
    """Host bytes per rank of ZeRO-2's gradient-accumulation buffers with ``offload_optimizer`` and
    ``gradient_accumulation_steps`` > 1 (DeepSpeed's ``accumulated_grads_in_cpu``).

    DeepSpeed 0.18.2 zero/stage_1_and_2.py:1421-1425 (``copy_grads_in_partition``: with
    ``cpu_offload`` and ``gradient_accumulation_steps > 1`` every parameter of the rank's partition
    goes through ``async_accumulate_grad_in_cpu_via_gpu``) and 1295-1298, 1325-1326 (its first call
    allocates ``torch.zeros(param.numel(), dtype=param.dtype, device=self.device)`` — the whole
    parameter's gradient, not its slice — pinned with ``get_accelerator().pin_memory`` when
    ``pin_memory``); 0.19.8 the same (lines 2160-2168, 1822-1826, 1852-1853) unless the gradient
    accumulation dtype is fp32 over a 16-bit model (its compact partition buffer instead). Kept for
    the rest of the run, so the save phase holds them too. Measured (DeepSpeed 0.19.8, CPU, 2 gloo
    ranks, a tiny Qwen3-MoE: benchmarks/results/offload_accumulation_host.txt): the engine's own
    buffers 86,316,544 and 86,839,808 bytes per rank against 86,316,032 here at ZeRO-2; none at
    ZeRO-1. Why ZeRO-1 differs between the two versions, line by line:

    * ZeRO-1 reduces only at the accumulation boundary (0.18.2 engine.py:2242-2245 and 0.19.8
      engine.py:3089-3092: ``reduce_gradients`` when ``is_gradient_accumulation_boundary()``), and
      there, with ``cpu_offload`` (which forces ``contiguous_gradients``, 0.18.2 line 240, 0.19.8
      line 300), ``reduce_ipg_grads`` calls ``copy_grads_in_partition`` for each parameter of the
      rank's partition (0.18.2 lines 1515-1517, 0.19.8 lines 2272-2274) — as ZeRO-2 does for the same
      parameters on every micro-step.
    * 0.18.2 ``copy_grads_in_partition`` (lines 1421-1425) calls the allocating
      ``async_accumulate_grad_in_cpu_via_gpu`` whenever ``gradient_accumulation_steps > 1``: the
      same buffers as ZeRO-2, per rank, from the first boundary on. Every release 0.18.2-0.18.9
      has that test.
    * 0.19.8 (lines 2166-2167) calls it only when ``micro_step_id > 0`` or off the boundary.
      ``setup_buckets`` raises ``micro_step_id`` only while ``ready_for_gradients`` is false (lines
      3257-3258; set true at 3280), and only ``_release_ipg_buffers`` clears that flag (lines
      924-932), called by the reduction epilogue (line 1061), which ZeRO-1 runs at the boundary
      alone on its default path. So at ZeRO-1 ``micro_step_id`` stays 0 from the first micro-step
      to the boundary (``step`` sets it back to -1, line 3017): no buffer. The test came with
      DeepSpeed commit aeb10bb1a ("Fix ZeRO-1/2 CPU-offloaded gradient loss with multiple
      backward() per step", #7981), first released in 0.19.0.

    zeroplan models 0.19's rule: it takes no DeepSpeed version (no option, no config key), so a
    ZeRO-1 run on DeepSpeed 0.18.x with optimizer offload and accumulation holds these buffers
    (this function's bytes for a ZeRO-2 plan of the same partition) beyond its host estimate.
    ``fp16_master_weights_and_gradients`` (0.18.2) / ``low_precision_master_weights_and_grads``
    (0.19.8) narrows into the fp32 gradient partition instead of allocating (0.18.2 lines 1296-1300,
    0.19.8 lines 1822-1826). Each of the ``sizes`` (elements of the
    trainable tensors) is ``bytes_per_param`` per element, a power-of-two block when ``pinned``
    (:func:`pinned_bytes`); a rank holds the parameters of its partition, about 1/``world_size`` of
    them (a parameter that straddles two partitions has a buffer on both ranks; not counted).
    """
    if pinned:
        total = sum(count * pinned_bytes(bytes_per_param * numel) for numel, count in _numel_counts(sizes))
    else:
        total = bytes_per_param * sum(sizes)
    return -(-total // world_size)


def zero3_pinned_param_blocks(sizes: tuple[int, ...], *, world_size: int, bytes_per_param: int, persistence_threshold: int) -> dict[int, int]:
    """Pinned host blocks (block bytes → count) that ZeRO-3 with ``offload_param`` cpu and
    ``pin_memory`` leaves behind, one per parameter.

    DeepSpeed 0.19.8 zero/partition_parameters.py:1836-1843 (``_partition_param``): each
    parameter's partition, ⌈numel/N⌉ elements, is its own ``torch.empty`` on the CPU, pinned with
    ``get_accelerator().pin_memory`` — one CachingHostAllocator block per parameter, rounded up to a
    power of two (:func:`pinned_bytes`). Parameters of at most ``stage3_param_persistence_threshold``
    elements stay whole on the device (``ds_persist``, line 1830). zero/stage3.py:975-1000 then pins
    one flat buffer per trainable parameter group (``_create_param_groups_fp16_flat_cpu_memory``,
    line 906) and ``_move_to_flat_buffer`` (lines 856-884: ``dest.data.copy_(src.data); src.data =
    dest.data``) points every trainable partition into it, so their own blocks are freed (a frozen
    parameter's stays in use) — to the allocator's free list: ATen/core/CachingHostAllocator.h ``maybe_cache_block``
    caches every freed block up to ``pinned_max_cached_size`` (unlimited by default), and only
    ``empty_cache`` unpins them. They stay resident beside the flat buffer.
    """
    blocks: dict[int, int] = {}
    for numel, count in _numel_counts(sizes):
        if numel > persistence_threshold:
            block = pinned_bytes(bytes_per_param * -(-numel // world_size))
            blocks[block] = blocks.get(block, 0) + count
    return blocks


@lru_cache(maxsize=64)
def _numel_counts(sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(numel, how many tensors have it), in first-seen order: a model repeats a few shapes per
    block, so its ~1,000 tensors are a dozen distinct sizes (read once per model, not per plan)."""
    counts: dict[int, int] = {}
    for numel in sizes:
        counts[numel] = counts.get(numel, 0) + 1
    return tuple(counts.items())


def reuse_cached_blocks(cached: dict[int, int], request_bytes: int) -> int:
    """Bytes a new pinned request of ``request_bytes`` adds, given freed blocks ``cached`` (bytes →
    count, consumed here): the caching host allocator serves a request from a free block of its own
    power-of-two size (CachingHostAllocator.h ``get_free_block(roundSize)``), else pins a new one."""
    block = pinned_bytes(request_bytes)
    if cached.get(block, 0) > 0:
        cached[block] -= 1
        return 0
    return block
