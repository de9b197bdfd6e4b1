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

    ``full`` and ``attention`` both checkpoint whole blocks here: the runtime has no generic way
    to find a task's attention inside a block, so ``attention`` is probed as ``full`` (the
    estimator's attention figure is then an underestimate of the saving, never of memory).
    ``selective-op`` applies PyTorch's op-level selective checkpointing with torchtitan's policy.
    The wrapper replaces the block's ``forward``, so module hooks (FSDP2's unshard/reshard)
    still run around the checkpointed call, as with torchtitan's checkpoint_wrapper.
    """
    if mode == "none":
        return
    from torch.utils.checkpoint import checkpoint

    context_fn = _selective_op_context if mode == "selective-op" else None
    for block in blocks:
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            if context_fn is None:
                return checkpoint(_inner, *args, use_reentrant=False, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

        block.forward = forward


def _selective_op_context():
    """torchtitan's op-level policy (torchtitan/models/llama3/infra/parallelize.py ``_save_list``,
    ``_custom_policy``): save SDPA outputs and every other ``aten.mm``, recompute the rest. The
    CPU flash kernel is listed beside the CUDA ones so that CPU probes apply the same policy."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = torch.ops.aten
    save = {ops.mm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(ops, name):
            save.add(getattr(ops, name).default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == ops.mm.default:
            counts[mode] += 1
        if func in save and not (func == ops.mm.default and counts[mode] % 2 == 0):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
