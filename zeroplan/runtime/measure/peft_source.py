"""Which trainable/frozen split the estimate beside a probe uses, and where it came from.

Sources, first one wins for the counts:

1. the run itself: the DeepSpeed engine's module counted by ``requires_grad`` (the worker's
   ``trainable_params`` / ``frozen_params``);
2. a LoRA layout: the task's ``model_spec`` when it carries one, else ``zeroplan probe``'s
   ``--lora-rank/--lora-targets/--lora-alpha/--adapter/--trainable-params/--base-quant``
   applied to the model the estimate uses (``--model``, the task's, or the discovered one).

The counts alone give gradients and optimizer states; which modules carry adapters (their
saved activations, ZeRO-3's released frozen modules) and how the base is stored come only from
a layout. When the run's count and the layout's disagree, the count wins and the layout is
dropped (its activations would belong to another adapter); the note says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from zeroplan.profiles.lora import PeftOptions
from zeroplan.spec import ModelSpec, PeftSpec, SpecError

__all__ = ["PeftFlags", "model_for_estimate"]


@dataclass(frozen=True)
class PeftFlags(PeftOptions):
    """``zeroplan probe``'s fine-tuning options (:class:`zeroplan.profiles.lora.PeftOptions`) with
    the model and precision they apply to, checked at construction for what needs no model."""

    model_arg: str | None = None
    """``--model`` as given (a preset or a config.json path: the module widths come from it)."""
    precision: str = "bf16"
    """Training precision (a quantized base needs bf16 or fp16)."""

    def __post_init__(self) -> None:
        self.check(self.precision)

    def for_model(self, model: ModelSpec) -> ModelSpec:
        """``model`` with the PeftSpec these options give (SpecError when they do not fit it)."""
        return self.apply(model, self.model_arg, precision=self.precision)


def model_for_estimate(
    model: ModelSpec,
    *,
    origin: str,
    trainable: int | None,
    frozen: int | None,
    flags: PeftFlags | None = None,
) -> tuple[ModelSpec, str | None]:
    """The model the estimate beside a probe uses, and a note saying where its split came from.

    ``origin`` names where ``model`` came from (``--model``, ``the task's model_spec``, ``the
    discovered model``); ``trainable`` / ``frozen`` are the engine's ``requires_grad`` counts
    (None where the backend does not report them).
    """
    layout = None
    given = flags is not None and flags.given
    if given and model.peft is not None and model.peft.method == "partial" and model.peft.source == "discovered":
        # Discovery counts requires_grad only (no layout): the frozen part is the base the
        # options adapt; the counts still come from the run below.
        model = dataclasses.replace(model, params=model.peft.frozen_params, peft=None)
    if model.peft is not None and model.peft.source != "discovered":
        layout = "the options given" if given and origin == "--model" else origin
    elif model.peft is None and given:
        try:
            model = flags.for_model(model)
            layout = flags.label
        except SpecError as exc:
            return _from_counts(model, trainable, frozen, why=f"{flags.label} does not fit {origin} ({exc})")
    if trainable is None:
        if layout is None:
            return model, None
        return model, (f"trainable/frozen from {layout}: {model.trainable_params:,} trainable, {model.frozen_params:,} "
                       "frozen (this backend does not report requires_grad counts)")
    if layout is None:
        return _from_counts(model, trainable, frozen, why=None)
    if trainable == model.trainable_params:
        sets = "; its LoRA layout (adapted modules, base storage) sets the activations" if model.peft.method == "lora" else ""
        return model, f"trainable/frozen from requires_grad ({trainable:,} trainable), as {layout} gives{sets}"
    return _from_counts(
        dataclasses.replace(model, peft=None), trainable, frozen,
        why=f"{layout} gives {model.trainable_params:,} trainable, the run {trainable:,}",
    )


def _from_counts(model: ModelSpec, trainable: int | None, frozen: int | None, *, why: str | None) -> tuple[ModelSpec, str | None]:
    """The split from the run's requires_grad counts alone (a partial fine-tune of ``model``)."""
    prefix = f"{why}; " if why else ""
    if model.peft is None and trainable and frozen and trainable < model.params:
        # Gradients and optimizer states for what requires grad; activations stay those of a
        # full fine-tune (which layers carry adapters is unknown without a layout). The engine
        # holds trainable + frozen parameters (a 4-bit base counts its packed bytes: never less
        # than the model's own count).
        total = max(model.params, trainable + frozen)
        model = dataclasses.replace(model, params=total, peft=PeftSpec(method="partial", base_params=total, trainable_params=trainable))
        return model, (f"{prefix}the run trains {trainable:,} of {trainable + frozen:,} parameters (requires_grad); the "
                       "estimate counts gradients and optimizer states for those only (give --lora-rank/--adapter for "
                       "LoRA's activations)")
    return model, (f"{prefix}the estimate counts every parameter as trainable" if why else None)
