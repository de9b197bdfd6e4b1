"""Independent check of the trace: bytes actually alive after a real forward, from allocations.

:func:`measure_retained_bytes` runs forward + loss on *real* CPU tensors and watches every
storage an aten op creates (a ``TorchDispatchMode``, below autograd — it does not use the
saved-tensor hooks the tracer counts with). What is still alive once forward returns, while the
caller holds the loss and the logits, is the activation memory backward will need. It shares
with the tracer only the model, the batch and the device-faithful op choices (dropout mask,
attention kernel, checkpoint wrappers), so both must agree.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from zeroplan.trace.recording import _enter_device_modes, _Recorder
from zeroplan.trace.tracer import Tracer, traced_mode

__all__ = ["RetainedBytes", "measure_retained_bytes"]


@dataclass(frozen=True)
class RetainedBytes:
    """Storages created during one real forward + loss and still alive after it."""

    retained: int
    """Bytes of storages created in forward (batch included) still alive after it."""
    allocated: int
    """Bytes of all storages created in forward, freed or not (for scale)."""
    storages: int
    """How many storages are still alive."""


def measure_retained_bytes(
    source: Any,
    *,
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    checkpointing: str = "none",
    flash_attention: bool = True,
    tracer: Tracer | None = None,
) -> RetainedBytes:
    """Allocate the model and a batch for real and return the activation bytes alive after forward.

    Only for small models: everything is allocated in host memory.
    """
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    if tracer is None:
        tracer = Tracer(source, precision=precision, flash_attention=flash_attention, fake=False)
    if tracer.fake:
        raise ValueError("measure_retained_bytes needs a real (fake=False) tracer")
    checkpointing = traced_mode(checkpointing)
    model = tracer._model
    existing = {StorageWeakRef(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())}

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.created: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    key = StorageWeakRef(leaf.untyped_storage())
                    if key not in existing and key not in self.created:
                        self.created[key] = leaf.untyped_storage().nbytes()
            return out

    recorder = _Recorder(set())  # regions only; nothing is counted through it here
    allocations = Allocations()
    with contextlib.ExitStack() as stack:
        _enter_device_modes(stack, blocks=tracer._blocks, source=tracer.source, recorder=recorder, checkpointing=checkpointing,
                            flash_attention=tracer.flash_attention)
        stack.enter_context(allocations)
        batch = tracer.source.make_batch(model, micro_batch=micro_batch, seq_len=seq_len)
        loss, outputs = tracer.source.forward_loss(model, batch)
    del batch
    alive = [(key, n) for key, n in allocations.created.items() if not key.expired()]
    result = RetainedBytes(
        retained=sum(n for _, n in alive),
        allocated=sum(allocations.created.values()),
        storages=len(alive),
    )
    del loss, outputs
    return result
