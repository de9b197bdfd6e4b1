"""What PyTorch's CUDA caching allocator reserves beyond the allocated peak. Stdlib only.

``torch.cuda.max_memory_reserved`` counts the segments the allocator got from ``cudaMalloc``;
``max_memory_allocated`` counts the blocks handed to tensors. The gap comes from two mechanisms,
both read from c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.x):

* **Block rounding.** ``round_size`` rounds every request up to a multiple of kMinBlockSize =
  512 B; ``get_allocation_size`` makes a new segment of kSmallBuffer = 2 MiB for requests up to
  kSmallSize = 1 MiB, kLargeBuffer = 20 MiB for requests under kMinLargeAlloc = 10 MiB, and
  otherwise the request rounded up to kRoundLarge = 2 MiB. ``should_split`` leaves the tail of
  a large block with the tensor unless more than 1 MiB remains. A large tensor therefore holds
  on average half a 2 MiB round-up that no one else can use: 1 MiB per live large tensor.
* **Stranded transients.** A tensor that lives only around the peak (the loss's gradients over
  the logits, the optimizer step's fp32 partition) gets its own segment the first time. Once
  freed, that segment is cached and ``should_split`` carves it up for the smaller tensors that
  follow (activations, gathered parameters); at the next step the same transient finds no
  contiguous free block and a new segment is reserved. In steady state the bytes of the peak's
  transients are reserved twice: once in use, once split among tensors that fit elsewhere.
  With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` segments grow in place and freed
  pages are unmapped, so transients strand nothing (``should_split`` then splits any remainder
  ≥ 512 B, and the 2 MiB page granularity stays).

**What an out-of-memory error leaves.** The stranded bytes are cached, not in use: when
``cudaMalloc`` fails, ``DeviceCachingAllocator::malloc`` (pytorch/pytorch at 001074d) retries
``alloc_block(params, false) || (release_available_cached_blocks(params) && alloc_block(...)) ||
(release_cached_blocks() && alloc_block(params, true))`` — "Free all non-split cached blocks and
retry alloc" — before it raises, and its OOM message notes that "at this point free_cached_blocks
has already returned all possible 'cached' memory to the driver. The only remaining 'cached'
memory is split from a larger block that is partially in-use." So a stranded segment raises
``max_memory_reserved`` (and nvidia-smi) on a GPU with room to spare, but on a full GPU it is
handed back and reused: only the rounding inside live blocks (:attr:`AllocatorReserve.held`)
counts towards running out of memory.

Public figures this is checked against (benchmarks/public_runs.json, docs/estimate.md):
torchtitan's Llama 3.1 8B FSDP runs on 8 and 128 H100s (``max_memory_reserved`` 82.4 and 67.0
GiB, docs/performance.md Tables 1 and 3), where the loss's fp32 gradients over a 128k vocabulary
are the peak's transients; torchtune issue #1185 (Llama 3 8B QLoRA on one A100: 16.39 GiB
reserved, 10.83 GiB with expandable segments); and out-of-memory messages, where the allocator
has already released its cached segments (``release_cached_blocks`` before failing) and the
reserve left is under 1 % (DeepSeek-Coder issue #78: 77.08 GiB allocated, 77.54 GiB reserved).
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroplan.estimator.frozen import built

__all__ = ["AllocatorReserve", "allocator_reserve", "ROUND_LARGE_BYTES"]

#: kRoundLarge in c10/cuda/CUDACachingAllocator.cpp: large segments are multiples of 2 MiB.
ROUND_LARGE_BYTES = 2 * 1024**2


@dataclass(frozen=True)
class AllocatorReserve:
    """Bytes reserved beyond the allocated peak, by mechanism (the ``allocator_reserve`` JSON object)."""

    block_rounding: int
    """Half a kRoundLarge (1 MiB) per large tensor alive at the peak."""
    stranded_transients: int
    """The peak's short-lived tensors, whose cached segments were split by smaller ones (0 with expandable segments)."""
    largest_transient: int
    """The largest of those transient allocations, bytes (what a fresh segment must fit)."""

    @property
    def total(self) -> int:
        """Reserved − allocated at the peak on a GPU with room to spare (``max_memory_reserved``)."""
        return self.block_rounding + self.stranded_transients

    @property
    def held(self) -> int:
        """The part a failing malloc cannot hand back (``release_cached_blocks`` frees only unsplit
        cached segments; the round-up tail inside a live block stays): what counts towards an OOM."""
        return self.block_rounding

    def as_dict(self) -> dict[str, int]:
        return {
            "block_rounding": self.block_rounding,
            "stranded_transients": self.stranded_transients,
            "largest_transient": self.largest_transient,
            "total": self.total,
            "held": self.held,
        }


def allocator_reserve(
    *,
    transients: dict[str, int],
    live_large_tensors: int,
    expandable_segments: bool = False,
) -> AllocatorReserve:
    """Reserved − allocated bytes at the peak (module docstring: the mechanisms and their source).

    ``transients``: the tensors allocated for the peak moment and freed right after it, by name
    (bytes each) — their sum is stranded unless ``expandable_segments``. ``live_large_tensors``:
    tensors over 1 MiB alive at the peak; each wastes half a 2 MiB round-up on average.
    The sequence length enters through the transients (the loss's N·V terms grow with s·b).
    """
    if live_large_tensors < 0 or any(v < 0 for v in transients.values()):
        raise ValueError("allocator_reserve needs non-negative counts and bytes")
    rounding = live_large_tensors * (ROUND_LARGE_BYTES // 2)
    stranded = 0 if expandable_segments else sum(transients.values())
    return built(
        AllocatorReserve,
        block_rounding=rounding,
        stranded_transients=stranded,
        largest_transient=max(transients.values(), default=0),
    )
