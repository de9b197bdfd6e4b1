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
from pathlib import Path

from zeroplan.spec import ModelSpec, PeftSpec, SpecError

__all__ = ["PeftFlags", "model_for_estimate"]


@dataclass(frozen=True)
class PeftFlags:
    """``zeroplan probe``'s fine-tuning options, checked here for what needs no model."""

    lora_rank: int | None = None
    """LoRA rank r (``--lora-rank``)."""
    lora_targets: str | None = None
    """Modules to adapt, comma-separated or ``all-linear`` (``--lora-targets``)."""
    lora_alpha: float | None = None
    """LoRA α (``--lora-alpha``); no effect on memory."""
    adapter: Path | None = None
    """A PEFT adapter_config.json or its folder (``--adapter``)."""
    trainable_params: str | None = None
    """``N`` or ``P%`` of the base trains (``--trainable-params``)."""
    base_quant: str | None = None
    """Storage of the frozen base: none, nf4 or int8 (``--base-quant``)."""
    model_arg: str | None = None
    """``--model`` as given (a preset or a config.json path: the module widths come from it)."""
    precision: str = "bf16"
    """Training precision (a quantized base needs bf16 or fp16)."""

    def __post_init__(self) -> None:
        from zeroplan.profiles.lora import read_adapter_config
        from zeroplan.spec.peft import BASE_QUANTS

        lora_flags = self.lora_rank is not None or self.lora_targets is not None or self.lora_alpha is not None
        if sum((lora_flags, self.adapter is not None, self.trainable_params is not None)) > 1:
            raise SpecError("give one of --lora-rank/--lora-targets, --adapter or --trainable-params, not several")
        if self.lora_rank is not None and self.lora_rank <= 0:
            raise SpecError(f"--lora-rank {self.lora_rank!r} is not valid; give a whole number >= 1 (typical: 8, 16, 64)")
        if (self.lora_targets is not None or self.lora_alpha is not None) and self.lora_rank is None:
            raise SpecError("--lora-targets/--lora-alpha need --lora-rank (e.g. --lora-rank 16)")
        quant = self.base_quant or "none"
        if quant not in BASE_QUANTS:
            raise SpecError(f"--base-quant {quant!r} is not valid; choose one of {', '.join(BASE_QUANTS)}")
        if quant != "none" and self.precision == "fp32":
            raise SpecError(
                f"--base-quant {quant} with --precision fp32: bitsandbytes bases compute in bf16 or fp16; use --precision bf16"
            )
        if quant != "none" and not (lora_flags or self.adapter is not None):
            raise SpecError(f"--base-quant {quant} needs an adapter (--lora-rank or --adapter): a quantized base cannot train")
        if self.adapter is not None:
            read_adapter_config(self.adapter)

    @property
    def given(self) -> bool:
        """Whether any fine-tuning option was given."""
        return any(v is not None for v in (self.lora_rank, self.lora_targets, self.lora_alpha, self.adapter,
                                           self.trainable_params, self.base_quant))

    @property
    def label(self) -> str:
        """The options as typed, for notes."""
        parts = []
        for flag, value in (("--lora-rank", self.lora_rank), ("--lora-targets", self.lora_targets),
                            ("--adapter", self.adapter), ("--trainable-params", self.trainable_params),
                            ("--base-quant", self.base_quant)):
            if value is not None:
                parts.append(f"{flag} {value}")
        return " ".join(parts)

    def apply(self, model: ModelSpec) -> ModelSpec:
        """``model`` with the PeftSpec these options give (SpecError when they do not fit it)."""
        from zeroplan.profiles.lora import resolve_peft

        return resolve_peft(
            model, model_arg=self.model_arg, precision=self.precision, lora_rank=self.lora_rank,
            lora_targets=self.lora_targets, lora_alpha=self.lora_alpha, adapter=self.adapter,
            trainable_params=self.trainable_params, base_quant=self.base_quant,
        )


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
            model = flags.apply(model)
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
