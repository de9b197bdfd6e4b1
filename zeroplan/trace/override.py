"""The hook the estimator uses to replace the activation formula with traced bytes.

Contract with :mod:`zeroplan.estimator.activations`::

    override = activation_override(model_path, training)   # SpecError on bad input, at once
    override(plan) -> int                                    # activation bytes per GPU for plan
    override.peak(plan) -> int                               # optional: measured fwd+bwd peak

``override.describe()`` is a one-line note for the estimate's ``notes``; ``override.as_dict()``
the fitted coefficients for ``--format json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from zeroplan.spec import Plan, TrainingSpec, compute_precision
from zeroplan.trace.fit import ActivationModel, fit_activation_model

__all__ = ["TracedActivationOverride", "activation_override"]


class TracedActivationOverride:
    """Callable ``plan -> activation bytes`` backed by an :class:`ActivationModel` at the training's seq_len."""

    def __init__(self, model: ActivationModel, training: TrainingSpec) -> None:
        self.model = model
        self.training = training

    def __call__(self, plan: Plan) -> int:
        """Activation bytes per GPU: the traced quantity plus :meth:`loss_gradient_bytes`."""
        # cpu_checkpointing (block inputs in host memory) is not modelled: the trace keeps them on the device.
        return self.model.bytes(plan.micro_batch, self.training.seq_len, plan.checkpointing) + self.loss_gradient_bytes(plan)

    @property
    def vocab_size(self) -> int | None:
        """The traced model's vocabulary (None when the model does not expose it)."""
        return self.model.tracer.vocab_size

    def loss_gradient_bytes(self, plan: Plan) -> int:
        """The loss's backward on top of what forward saves: the fp32 gradients of the log-softmax
        input and output, 2 × 4·s·b·V bytes. Checked against a traced forward + backward peak
        (Llama-3-8B, s 4096, b 1: 27.58 GiB saved + 3.91 GiB = 31.49 GiB, equal). Zero for
        ``measure="peak"`` (already in the peak) and when the vocabulary is unknown."""
        if self.model.measure == "peak" or not self.vocab_size:
            return 0
        return 8 * self.training.seq_len * plan.micro_batch * self.vocab_size

    def peak(self, plan: Plan) -> int:
        """Largest activation bytes alive during forward + backward for ``plan`` (a fresh fake
        forward + backward, not the fit): includes the loss's fp32 gradients (2 × 4·s·b·V) and
        activation gradients the saved-tensor count leaves out. About 2× a trace's time."""
        return self.model.tracer.peak(
            micro_batch=plan.micro_batch, seq_len=self.training.seq_len, checkpointing=plan.checkpointing
        ).peak

    def breakdown(self, plan: Plan) -> dict[str, int]:
        """Per-component bytes (embeddings, layers, logits, recompute, loss_gradients, total) for ``plan``."""
        parts = dict(self.model.breakdown(plan.micro_batch, self.training.seq_len, plan.checkpointing))
        loss = self.loss_gradient_bytes(plan)
        if loss:
            parts["loss_gradients"] = loss
            parts["total"] += loss
        return parts

    def describe(self) -> str:
        attention = "flash attention" if self.model.tracer.flash_attention else "eager attention"
        if self.model.measure == "peak":
            what = "forward + backward peak"
        elif self.vocab_size:
            what = "saved for backward + logits, plus the loss's backward gradients 8·s·b·V"
        else:
            what = "saved for backward + logits; vocabulary unknown, so not the loss's backward gradients"
        return (
            f"activations ({what}) traced from {self.model.source} under FakeTensorMode "
            f"({self.model.tracer.precision}, {attention}, seq_len {self.training.seq_len}), not the formula"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"method": "trace", **self.model.as_dict()}


def activation_override(model_path: str | Path, training: TrainingSpec, *, measure: str = "saved") -> TracedActivationOverride:
    """Trace ``model_path`` (a Hugging Face config.json or a zeroplan task script) for ``training``.

    ``measure="saved"`` (default, ~0.5 s per trace for Llama-3-8B at 4096 tokens): bytes saved
    for backward + logits + one block's recompute — the formula's quantity — to which the
    override adds the loss's backward gradients (2 × 4·s·b·V,
    :meth:`TracedActivationOverride.loss_gradient_bytes`). ``measure="peak"``: the largest live bytes over forward +
    backward (activation gradients included), about 8× slower.

    Builds the model once under FakeTensorMode and fits the un-checkpointed mode immediately, so
    a missing transformers, an unknown model_type or a config that fails to build raises
    :class:`~zeroplan.spec.SpecError` here, before any table is printed. Checkpointed modes are
    traced on first use.
    """
    model = fit_activation_model(
        model_path,
        seq_len=training.seq_len,
        # The traced model is built in the compute dtype: bf16-pure's activations are bf16's.
        precision=compute_precision(training.precision),
        flash_attention=training.flash_attention,
        checkpointing=("none",),
        measure=measure,
    )
    return TracedActivationOverride(model, training)
