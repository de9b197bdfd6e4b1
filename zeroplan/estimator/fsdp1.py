"""PyTorch FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True``) where it differs from
FSDP2 in memory: flat parameters carry gradients for a whole unit. Stdlib only.

``--engine fsdp1`` is FSDP1 wrapped per transformer block and at the root, as Lightning Fabric's
``FSDPStrategy(auto_wrap_policy={Block})`` (LitGPT's ``finetune/lora.py``) and Hugging Face
accelerate's ``TRANSFORMER_BASED_WRAP`` run it. (Hugging Face's Trainer with a peft model swaps in
peft's ``fsdp_auto_wrap_policy``, which wraps the adapters separately — transformers
``distributed/fsdp.py`` — so frozen blocks carry no gradient: ``--engine fsdp``'s model.) Everything else is FSDP2's model
(:mod:`zeroplan.estimator.fsdp`); three terms change, read from torch/distributed/fsdp/ (line
numbers of torch 2.13; the same code since torch 2.0):

* ``_flat_param.py`` ``FlatParamHandle._validate_tensors_to_flatten`` (lines 798-836): a unit's
  parameters become one ``FlatParameter`` that requires grad when *any* of them does, so a
  block mixing frozen weights and LoRA adapters gets a gradient the size of the whole block.
  ``_wrap_utils.py`` lines 158-167 warn of exactly this: "the gradient memory usage will be
  higher than expected ({total} numel instead of {nonfrozen} numel before sharding via
  reduce-scatter)". The optimizer still holds states for the trainable parameters only.
* ``_runtime_utils.py`` ``_post_backward_hook`` (lines 743-746): under ``no_sync()`` — Fabric's
  ``no_backward_sync`` (lightning/fabric/strategies/fsdp.py ``_FSDPBackwardSyncControl``) calls it
  on every micro-step but the last — the hook returns before
  the reduce-scatter and before any cast to ``reduce_dtype``: each unit keeps its *unsharded*
  flat gradient in the compute dtype until the last micro-step's backward.
* ``_runtime_utils.py`` ``_post_forward_reshard`` (lines 493-500): the root unit (embeddings,
  final norm, head) is not resharded after forward under ``FULL_SHARD``; its unsharded
  parameters stay from the forward through the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FlatUnitGradients", "flat_unit_gradients"]


@dataclass(frozen=True)
class FlatUnitGradients:
    """Gradient elements per FSDP1 unit: a unit's whole flat parameter when any of it trains."""

    root: int
    """Elements of the root unit's gradient (the whole root when any root parameter trains, else 0)."""
    block: int
    """Elements of one block unit's gradient (the whole block when any block parameter trains, else 0)."""
    blocks: int
    """Number of block units."""

    @property
    def total(self) -> int:
        """Elements of every unit's gradient together (unsharded)."""
        return self.root + self.block * self.blocks


def flat_unit_gradients(*, root_params: int, block_params: int, blocks: int, root_trainable: int,
                        block_trainable: int) -> FlatUnitGradients:
    """Gradient elements under FSDP1 flat parameters (module docstring: ``FlatParameter``
    requires grad when any parameter it flattens does).

    ``root_params``/``block_params``: elements of the root unit and of one block unit;
    ``root_trainable``/``block_trainable``: their trainable elements. A unit with none trainable
    has no gradient; a unit with any has one of its full size. With nothing frozen this equals
    the trainable count, as under FSDP2.
    """
    return FlatUnitGradients(
        root=root_params if root_trainable > 0 else 0,
        block=block_params if block_trainable > 0 else 0,
        blocks=blocks,
    )
