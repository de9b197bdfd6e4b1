"""Pieces both backends share: device, batch moves, per-block activation checkpointing."""

from __future__ import annotations

import os

import torch

__all__ = ["device_for_rank", "to_device", "apply_checkpointing", "task_blocks"]


def device_for_rank() -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def to_device(batch, device: torch.device):
    """Move every tensor in a (nested) batch to ``device``."""
    return torch.utils._pytree.tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)


def task_blocks(task, model) -> list:
    """The task's blocks (checkpointing and sharding units), or an empty list."""
    return list(task.blocks(model)) if task.blocks is not None else []


def apply_checkpointing(blocks: list, mode: str) -> None:
    """Recompute each block's activations in backward (``torch.utils.checkpoint``, non-reentrant).

    ``full`` and ``selective`` both checkpoint whole blocks here: the runtime has no generic way
    to find a task's attention inside a block, so ``selective`` is probed as ``full`` (the
    estimator's selective figure is then an underestimate of the saving, never of memory).
    The wrapper replaces the block's ``forward``, so module hooks (FSDP2's unshard/reshard)
    still run around the checkpointed call, as with torchtitan's checkpoint_wrapper.
    """
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint

    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
