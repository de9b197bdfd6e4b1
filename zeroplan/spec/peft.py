"""PeftSpec: which parameters train, which are frozen, and how the frozen base is stored.

A full fine-tune trains every parameter. Parameter-efficient fine-tuning freezes the base model
and trains either a small adapter (LoRA, Hu et al. 2021, arXiv 2106.09685) or a chosen subset.
The frozen base may be stored quantized (QLoRA, Dettmers et al. 2023, arXiv 2305.14314: NF4
with double quantization; or LLM.int8, arXiv 2208.07339).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zeroplan.spec.errors import SpecError, check_choice, check_positive_int

__all__ = ["AdaptedModule", "BASE_QUANTS", "PEFT_METHODS", "PeftSpec"]

#: How the frozen base weights are stored: in the training precision, NF4 (QLoRA) or int8.
BASE_QUANTS = ("none", "nf4", "int8")
#: lora: adapters added to a frozen base; partial: a subset of the base trains (--trainable-params).
PEFT_METHODS = ("lora", "partial")


@dataclass(frozen=True)
class AdaptedModule:
    """One kind of linear module that carries a LoRA adapter (e.g. every layer's q_proj)."""

    name: str
    """Module path inside its block (``self_attn.q_proj``), or the top-level name (``lm_head``)."""
    in_features: int
    """Input width of the base module (LoRA A is in_features × r)."""
    out_features: int
    """Output width of the base module (LoRA B is r × out_features)."""
    count: int
    """How many such modules the model has (num_layers for per-block modules)."""
    rank: int
    """LoRA rank r of this module (rank_pattern may differ from the default)."""

    def __post_init__(self) -> None:
        for name in ("in_features", "out_features", "count", "rank"):
            check_positive_int(f"AdaptedModule.{name}", getattr(self, name), maximum=10**9)


@dataclass(frozen=True)
class PeftSpec:
    """Trainable and frozen parameter counts of a parameter-efficient run (a frozen value object)."""

    method: str
    """``lora`` (adapters on a frozen base) or ``partial`` (a subset of the base trains)."""
    base_params: int
    """Parameters of the base model (ModelSpec.params)."""
    trainable_params: int
    """Parameters with requires_grad: they get gradients and optimizer states (Ψ_t)."""
    added_params: int = 0
    """Parameters the adapter adds to the base (LoRA A and B, DoRA magnitudes, modules_to_save copies)."""
    base_quant: str = "none"
    """Storage of the frozen base's linear weights: none (training precision), nf4 or int8."""
    quantized_params: int = 0
    """Base parameters stored quantized (the blocks' linear weights; embeddings, norms, biases and
    the output layer stay in floating point)."""
    quantized_rows: int = 0
    """Output rows of the quantized matrices (int8 keeps one fp32 scale per row)."""
    largest_quantized_numel: int = 0
    """Elements of the largest quantized matrix (its dequantized copy is the forward workspace)."""
    rank: int | None = None
    """Default LoRA rank r (None for ``partial``)."""
    alpha: float | None = None
    """LoRA scaling numerator α (scale α/r); no effect on memory."""
    dropout: float = 0.0
    """lora_dropout: above 0 each adapted input is saved a second time (dropout output) plus a mask."""
    targets: tuple[str, ...] = ()
    """target_modules as given (names, or ``all-linear``)."""
    adapted: tuple[AdaptedModule, ...] = field(default=())
    """The modules carrying adapters, by kind."""
    source: str = "flags"
    """Where the spec came from: ``flags`` or the adapter_config.json path."""
    notes: tuple[str, ...] = field(default=())
    """What the user should know about how the counts were obtained."""

    def __post_init__(self) -> None:
        check_choice("peft.method", self.method, PEFT_METHODS)
        check_choice("base_quant", self.base_quant, BASE_QUANTS)
        check_positive_int("peft.base_params", self.base_params, maximum=10**14)
        check_positive_int("trainable_params", self.trainable_params, maximum=10**14)
        check_positive_int("added_params", self.added_params, minimum=0, maximum=10**14)
        check_positive_int("quantized_params", self.quantized_params, minimum=0, maximum=self.base_params)
        if self.trainable_params > self.base_params + self.added_params:
            raise SpecError(
                f"trainable_params={self.trainable_params} exceeds the model's {self.base_params + self.added_params} "
                "parameters; give fewer (or a percentage such as 1%)"
            )
        if self.method == "lora":
            if self.rank is None:
                raise SpecError("LoRA needs a rank; give --lora-rank (e.g. 16)")
            check_positive_int("lora rank", self.rank, maximum=10**6)
        if self.base_quant != "none" and self.quantized_params == 0:
            raise SpecError(f"base_quant={self.base_quant} but no base parameters are quantizable")
        if not 0.0 <= self.dropout < 1.0:
            raise SpecError(f"lora dropout={self.dropout} is not valid; give a value in [0, 1)")

    @property
    def total_params(self) -> int:
        """Base plus adapter parameters."""
        return self.base_params + self.added_params

    @property
    def frozen_params(self) -> int:
        """Parameters without gradients or optimizer states (total − trainable)."""
        return self.total_params - self.trainable_params

    @property
    def label(self) -> str:
        """Short description for table headers, e.g. ``LoRA r16 on q_proj,v_proj, nf4 base``."""
        if self.method == "lora":
            text = f"LoRA r{self.rank} on {','.join(self.targets) or 'adapter'}"
        else:
            text = "partial fine-tune"
        if self.base_quant != "none":
            text += f", {self.base_quant} base"
        return text

    @classmethod
    def from_dict(cls, data: dict) -> "PeftSpec":
        """Inverse of :meth:`as_dict` (derived keys such as ``frozen_params`` are ignored)."""
        d = dict(data)
        d.pop("frozen_params", None)
        adapted = tuple(AdaptedModule(**m) for m in d.pop("adapted_modules", ()))
        return cls(**{**d, "targets": tuple(d.get("targets", ())), "notes": tuple(d.get("notes", ())), "adapted": adapted})

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "base_params": self.base_params,
            "trainable_params": self.trainable_params,
            "frozen_params": self.frozen_params,
            "added_params": self.added_params,
            "base_quant": self.base_quant,
            "quantized_params": self.quantized_params,
            "quantized_rows": self.quantized_rows,
            "largest_quantized_numel": self.largest_quantized_numel,
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
            "adapted_modules": [
                {"name": m.name, "in_features": m.in_features, "out_features": m.out_features, "count": m.count, "rank": m.rank}
                for m in self.adapted
            ],
            "source": self.source,
            "notes": list(self.notes),
        }
