"""ModelSpec: the shape of a transformer, enough for memory, traffic and FLOP arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from typing import TYPE_CHECKING

from zeroplan.spec.errors import SpecError, check_positive_int

if TYPE_CHECKING:  # loaded where a model has them (a dense model's estimate needs none of them)
    from zeroplan.spec.mla import MlaSpec
    from zeroplan.spec.moe import MoeSpec
    from zeroplan.spec.peft import PeftSpec
    from zeroplan.spec.vision import VisionTowerSpec

__all__ = ["ModelSpec", "MAX_PARAMS", "ATTENTION_KERNELS", "derive_shape_from_params", "format_params"]

#: Largest model zeroplan accepts (100 trillion parameters); anything above is a typo.
MAX_PARAMS = 10**14
#: ModelSpec.attention_kernel values.
ATTENTION_KERNELS = ("sdpa", "sdpa-v-dim", "eager")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-style transformer as the estimator sees it.

    ``params`` is authoritative for model-state memory (2Ψ + 2Ψ + KΨ); the shape fields feed
    activations, FLOPs, bucket sizes and the largest-layer terms.
    """

    name: str
    """Preset name, config path, or ``"<N> params"`` for a shape derived from a count."""
    params: int
    """Total trainable parameters Ψ (embeddings included, tied ones counted once)."""
    hidden_size: int
    """Model width h."""
    num_layers: int
    """Transformer blocks L."""
    num_heads: int
    """Attention heads a."""
    num_kv_heads: int
    """Key/value heads (== num_heads without GQA/MQA)."""
    ffn_size: int
    """Inner MLP width (4h for GPT, ~8h/3 rounded for SwiGLU models)."""
    vocab_size: int
    """Vocabulary V (rows of the embedding and of the output projection)."""
    tied_embeddings: bool = True
    """Output projection shares the input embedding."""
    gated_mlp: bool = False
    """SwiGLU/GeGLU MLP (three matrices instead of two)."""
    largest_layer_params: int = 0
    """Parameters of the largest single module (0: computed as max(embedding, one block's largest matrix))."""
    source: str = "given"
    """Where the shape came from: ``preset``, ``config.json``, ``derived`` (from --params) or ``given``."""
    notes: tuple[str, ...] = field(default=())
    """Things the user should know about how this spec was obtained."""
    peft: PeftSpec | None = None
    """Frozen base and trainable subset or adapter (LoRA/QLoRA); None for a full fine-tune."""
    fused_qkv: bool = False
    """Q, K and V are one h×(h + 2·kv) weight (GPT-2's ``c_attn``, GPT-NeoX's and BLOOM's
    ``query_key_value``, Phi-3's ``qkv_proj``), so their gradient is one tensor: what a reduce
    bucket sees (stage 1 keeps gradients larger than the bucket whole until the epilogue)."""
    dropout: bool | None = None
    """Training applies dropout, so autograd saves 1-byte masks (attention output, MLP output,
    embeddings); None: by architecture — GPT-style blocks do (GPT-2's p = 0.1), gated-MLP (Llama
    family) ones don't."""
    parameter_sizes: tuple[tuple[int, int], ...] = ()
    """``(elements, count)`` of the real model's parameters, largest first, for a discovered model
    that is not a transformer (its shape fields are guesses); what DeepSpeed tests against its
    reduce bucket one parameter at a time. Empty: the sizes follow from the shape."""
    qk_norm: bool = False
    """Per-head RMSNorm on Q and K before attention (Qwen3's ``q_norm``/``k_norm``): each saves its
    fp32 input and its normalized output for backward."""
    attention_kernel: str = "sdpa"
    """What attention runs as in transformers, which decides whether the a·s² probabilities are
    saved (:mod:`zeroplan.estimator.attention_kernel`): ``sdpa`` (fused kernels wherever flash
    attention is on), ``sdpa-v-dim`` (Q·K head dim differs from V's, DeepSeek's MLA: CUDA's
    memory-efficient kernel takes it, the CPU flash kernel does not), ``eager`` (no SDPA path:
    gpt-oss's attention sinks)."""
    mla: MlaSpec | None = None
    """DeepSeek's multi-head latent attention widths (None: standard attention with ``head_dim``)."""
    moe: MoeSpec | None = None
    """Mixture-of-experts layers (None: a dense model). ``params`` then counts every expert (model
    states), ``active_params`` what one token touches (FLOPs), and ``ffn_size`` is the MLP width a
    token goes through in an MoE layer: k·I routed plus the shared experts' width."""
    vision: VisionTowerSpec | None = None
    """A vision-language model's vision tower (None: text only). Its parameters are in ``params``;
    its activations come from ``TrainingSpec.image_patches`` (:mod:`zeroplan.estimator.vision`)."""

    def __post_init__(self) -> None:
        check_positive_int("params", self.params, maximum=MAX_PARAMS)
        if self.peft is not None and self.peft.base_params != self.params:
            raise SpecError(
                f"peft spec counts a base of {self.peft.base_params} parameters but the model has {self.params}"
            )
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_size", "vocab_size"):
            check_positive_int(name, getattr(self, name), maximum=10**8)
        if self.hidden_size % self.num_heads:
            raise SpecError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads}"
            )
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise SpecError(f"attention_kernel={self.attention_kernel!r} is not valid; choose {', '.join(ATTENTION_KERNELS)}")
        if not isinstance(self.qk_norm, bool):
            raise SpecError(f"qk_norm={self.qk_norm!r} is not valid; give true or false")
        if not isinstance(self.fused_qkv, bool):
            raise SpecError(f"fused_qkv={self.fused_qkv!r} is not valid; give true or false")
        if self.dropout is not None and not isinstance(self.dropout, bool):
            raise SpecError(f"dropout={self.dropout!r} is not valid; give true, false or null (by architecture)")
        if self.mla is not None:
            from zeroplan.spec.mla import MlaSpec

            if not isinstance(self.mla, MlaSpec):
                raise SpecError(f"mla={self.mla!r} is not valid; give an MlaSpec or None")
        if self.moe is not None:
            from zeroplan.spec.moe import MoeSpec

            if not isinstance(self.moe, MoeSpec):
                raise SpecError(f"moe={self.moe!r} is not valid; give a MoeSpec or None")
        if self.moe is not None and self.moe.moe_layers > self.num_layers:
            raise SpecError(f"moe.moe_layers={self.moe.moe_layers} exceeds num_layers={self.num_layers}")
        if self.moe is not None and self.moe.inactive_params >= self.params:
            raise SpecError(
                f"moe: {self.moe.inactive_params} inactive expert parameters exceed params={self.params}; "
                "the expert shape does not belong to this model"
            )
        if self.largest_layer_params < 0:
            raise SpecError(f"largest_layer_params={self.largest_layer_params} must be >= 0")
        if self.largest_layer_params == 0:
            object.__setattr__(self, "largest_layer_params", self._largest_layer())

    @property
    def has_dropout(self) -> bool:
        """Whether blocks save dropout masks: ``dropout`` when given, else GPT-style (not gated) blocks."""
        return (not self.gated_mlp) if self.dropout is None else self.dropout

    @property
    def head_dim(self) -> int:
        """h / a."""
        return self.hidden_size // self.num_heads

    @property
    def embedding_params(self) -> int:
        """Input embedding V·h (the output projection is another V·h when untied)."""
        return self.vocab_size * self.hidden_size

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block from the shape (weights only, biases ignored).

        Attention: Q and O are h×h, K and V are h×(kv_heads·head_dim); MLP: 2 or 3 matrices h×ffn.
        """
        h = self.hidden_size
        kv = self.num_kv_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn_size
        return attn + mlp

    @property
    def total_params(self) -> int:
        """Every parameter the engine holds: the base plus any adapter."""
        return self.params + (self.peft.added_params if self.peft else 0)

    @property
    def trainable_params(self) -> int:
        """Parameters with gradients and optimizer states (all of them without ``peft``)."""
        return self.peft.trainable_params if self.peft else self.params

    @property
    def active_params(self) -> int:
        """Parameters one token's forward touches: every non-expert parameter, the top-k routed
        experts of each MoE layer and the shared experts (``total_params`` for a dense model).
        FLOPs and time use it; memory uses ``total_params``."""
        return self.total_params - (self.moe.inactive_params if self.moe else 0)

    @property
    def frozen_params(self) -> int:
        """Parameters held without gradients or optimizer states."""
        return self.total_params - self.trainable_params

    def _largest_layer(self) -> int:
        # DeepSpeed's ZeRO-3 estimator uses the largest *layer* (module) because a whole module's
        # parameters are gathered at once; embedding tables are usually the largest one.
        h = self.hidden_size
        largest_matrix = max(h * self.ffn_size, h * h)
        if self.moe is not None:
            # Fused experts are one module's parameters, gathered whole; a ModuleList expert is one MLP.
            largest_matrix = max(largest_matrix, self.moe.layer_experts_params if self.moe.fused_experts else self.moe.expert_params)
        return max(self.embedding_params, largest_matrix)

    def as_dict(self) -> dict:
        """JSON-ready dict (the `model` object of docs/design.md)."""
        return {
            "name": self.name,
            "params": self.params,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "ffn_size": self.ffn_size,
            "vocab_size": self.vocab_size,
            "tied_embeddings": self.tied_embeddings,
            "gated_mlp": self.gated_mlp,
            "largest_layer_params": self.largest_layer_params,
            "source": self.source,
            "notes": list(self.notes),
            **({"parameter_sizes": [list(p) for p in self.parameter_sizes]} if self.parameter_sizes else {}),
            "trainable_params": self.trainable_params,
            "frozen_params": self.frozen_params,
            "peft": self.peft.as_dict() if self.peft else None,
            "dropout": self.dropout,
            "fused_qkv": self.fused_qkv,
            "qk_norm": self.qk_norm,
            "attention_kernel": self.attention_kernel,
            "mla": self.mla.as_dict() if self.mla else None,
            "active_params": self.active_params,
            "moe": self.moe.as_dict() if self.moe else None,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "ModelSpec":
        """Inverse of :meth:`as_dict`: derived keys (``trainable_params``, ``frozen_params``) are
        ignored and ``peft`` is rebuilt."""
        d = {k: v for k, v in data.items() if k not in ("trainable_params", "frozen_params", "active_params")}
        if "notes" in d:
            d["notes"] = tuple(d["notes"])
        if "parameter_sizes" in d:
            d["parameter_sizes"] = tuple((int(n), int(c)) for n, c in d["parameter_sizes"])
        from zeroplan.spec.mla import MlaSpec
        from zeroplan.spec.moe import MoeSpec
        from zeroplan.spec.peft import PeftSpec

        if d.get("peft") is not None:
            d["peft"] = PeftSpec.from_dict(d["peft"])
        if d.get("moe") is not None:
            d["moe"] = MoeSpec.from_dict(d["moe"])
        if d.get("mla") is not None:
            d["mla"] = MlaSpec.from_dict(d["mla"])
        return cls(**d)

    @classmethod
    def from_params(cls, params: float, *, vocab_size: int = 50257) -> "ModelSpec":
        """A plausible GPT-3-style shape for a bare parameter count.

        Rule (documented in the output): GPT-3's family (Brown et al. 2020, Table 2.1) keeps
        head_dim = 128 and h ≈ 128·L at scale, with Ψ ≈ 12·L·h² + V·h. We solve
        12·(h/128)·h² + V·h = Ψ for h, round h to a multiple of 512 from 2048 up (heads of 128, a
        multiple of 4 of them) and of 128 below (at least 256; heads of 64), then pick L so that
        12·L·h² + V·h is closest to Ψ. For 175e9 this gives h = 12288, L = 96, 96 heads — GPT-3
        itself; for 7e9 h = 4096 and 32 heads, as LLaMA-7B.
        """
        return derive_shape_from_params(params, vocab_size=vocab_size)


def format_params(n: float) -> str:
    """A parameter count as people write it: ``8.03B``, ``2T``, ``125M`` (3 significant digits)."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return f"{n:.0f}"


def derive_shape_from_params(params: float, *, vocab_size: int = 50257) -> ModelSpec:
    """See :meth:`ModelSpec.from_params`."""
    if isinstance(params, bool) or not isinstance(params, (int, float)) or not math.isfinite(params):
        raise SpecError(f"params={params!r} is not a finite number; give e.g. 7e9")
    if params < 1e6:
        raise SpecError(f"params={params:g} is too small; zeroplan models transformers of >= 1e6 parameters")
    if params > MAX_PARAMS:
        raise SpecError(f"params={params:g} is absurd; the largest accepted is {MAX_PARAMS:.0e}")
    n = int(round(params))
    # Solve 12 h^3 / 128 + V h = N by bisection (monotone in h).
    lo, hi = 1.0, 1e7
    for _ in range(200):
        mid = (lo + hi) / 2
        if 12 * mid**3 / 128 + vocab_size * mid < n:
            lo = mid
        else:
            hi = mid
    # Head count: h rounded to a multiple of 512 from h = 2048 up, so that heads = h/128 is a
    # multiple of 4 as in the published models of those sizes (GPT-3 XL 2048/16 heads of 128,
    # 6.7B 4096/32, 13B 5120/40, 175B 12288/96; LLaMA 7B 4096/32, 13B 5120/40, 33B 6656/52,
    # 65B 8192/64 — Touvron et al. 2023, arXiv 2302.13971, Table 2) and tensor-parallel layouts
    # need (heads divisible by 2, 4 or 8); plain multiples of 128 gave 33 heads for 7e9. Below,
    # a multiple of 128 with 64-wide heads, as GPT-2 and GPT-3's small models use (768/12, 1024/16).
    if lo >= 2048:
        h = int(round(lo / 512)) * 512
        head_dim = 128
    else:
        h = max(256, int(round(lo / 128)) * 128)
        head_dim = 64
    # Small models: the embedding may already exceed N; keep at least one block.
    layers = max(1, int(round((n - vocab_size * h) / (12 * h * h))))
    heads = h // head_dim
    note = (
        f"shape derived from --params {format_params(params)}: h={h}, L={layers}, heads={heads}, V={vocab_size} "
        f"(GPT-3 rule: h≈128·L, Ψ≈12·L·h²+V·h; head_dim {head_dim})"
    )
    return ModelSpec(
        name=f"{format_params(params)} params",
        params=n,
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        ffn_size=4 * h,
        vocab_size=vocab_size,
        tied_embeddings=True,
        gated_mlp=False,
        source="derived",
        notes=(note,),
    )
