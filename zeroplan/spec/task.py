"""A zeroplan task: a training problem described by builders, so zeroplan owns the loop and can
run it on any backend (DeepSpeed or FSDP2), trace its activations or time it.

A script is a task when it defines ``zeroplan_task()`` at top level returning a :class:`Task`.
The worker sets ``sys.argv`` to the script and its arguments before calling it, so the task may
read its own flags (see examples/gpt_task.py). :func:`load_task` is the one loader: the probe
worker, the tuner, the tracer and calibration all use it. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from zeroplan.spec.errors import SpecError
from zeroplan.spec.model import ModelSpec
from zeroplan.spec.training import LOSSES

__all__ = ["NotATask", "Task", "load_task"]


@dataclass(frozen=True)
class Task:
    """Builders for one training problem; the backend supplies the engine, the optimizer and the loop."""

    build_model: Callable[[], Any]
    """Returns a fresh ``torch.nn.Module`` in fp32 on CPU (the backend moves and wraps it)."""
    make_batch: Callable[[int, int, int], Any]
    """``(micro_batch, step, rank) -> batch``: one micro-batch (tensors on CPU; moved by the backend)."""
    loss_fn: Callable[[Any, Any], Any]
    """``(model, batch) -> scalar loss tensor``; ``model`` is the wrapped module (engine, DDP, FSDP)."""
    seq_len: int | None = None
    """Tokens per sample, for tokens/s (None: throughput in samples only)."""
    blocks: Callable[[Any], list] | None = None
    """``model -> [block modules]``: units for activation checkpointing and FSDP sharding."""
    model_spec: ModelSpec | None = None
    """Shape of the model for the estimator (None: probe without an estimate)."""
    lr: float = 1e-4
    """Learning rate of the optimizer the FSDP backend builds (DeepSpeed takes its config's)."""
    loss: str | None = None
    """What ``loss_fn`` keeps over the logits, for the estimate (``zeroplan.spec.LOSSES``): ``plain``
    when it computes ``F.cross_entropy(logits.float(), y)`` and drops the logits, ``hf`` when the
    model returns them in an output object held through backward; None: ``hf``."""

    def __post_init__(self) -> None:
        for name in ("build_model", "make_batch", "loss_fn"):
            if not callable(getattr(self, name)):
                raise SpecError(f"Task.{name} must be callable, got {type(getattr(self, name)).__name__}")
        if self.blocks is not None and not callable(self.blocks):
            raise SpecError(f"Task.blocks must be callable or None, got {type(self.blocks).__name__}")
        if self.seq_len is not None and (not isinstance(self.seq_len, int) or self.seq_len < 1):
            raise SpecError(f"Task.seq_len={self.seq_len!r} is not valid; give a whole number >= 1 or None")
        if self.loss is not None and self.loss not in LOSSES:
            raise SpecError(f"Task.loss={self.loss!r} is not valid; choose one of {', '.join(LOSSES)} or None")
        if not self.lr > 0:
            raise SpecError(f"Task.lr={self.lr!r} is not valid; give a positive learning rate")


class NotATask(TypeError):
    """The script defines no ``zeroplan_task()``, or it returns something other than a :class:`Task`."""


def load_task(script: str | Path, args: tuple[str, ...] = (), *, restore_argv: bool = True) -> Task:
    """Run ``script`` (``runpy``, as module ``__zeroplan_task__``, so its ``if __name__ ==
    "__main__"`` block stays out) with ``sys.argv = [script, *args]`` — the worker's view — and
    return what its ``zeroplan_task()`` builds. The one loader the probe worker, the tuner, the
    tracer and calibration use. ``restore_argv=False`` leaves ``sys.argv`` set (the worker's process runs the task).

    :class:`NotATask` (a TypeError) when the script has no ``zeroplan_task()`` or it returns
    something else than a Task; anything the script raises propagates.
    """
    import runpy
    import sys

    script = str(script)
    saved = sys.argv
    sys.argv = [script, *args]
    try:
        namespace = runpy.run_path(script, run_name="__zeroplan_task__")
        factory = namespace.get("zeroplan_task")
        if not callable(factory):
            raise NotATask(f"{script} has no top-level function zeroplan_task()")
        task = factory()
    finally:
        if restore_argv:
            sys.argv = saved
    if not isinstance(task, Task):
        raise NotATask(f"zeroplan_task() in {script} returned {type(task).__name__}, not zeroplan.runtime.rank.task.Task")
    return task
