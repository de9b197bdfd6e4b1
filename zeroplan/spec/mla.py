"""MlaSpec: DeepSeek's multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 §2.1): queries
and keys/values go through low-rank latents, and the Q·K head dim (nope + rope) differs from V's."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zeroplan.spec.errors import SpecError, check_positive_int

__all__ = ["MlaSpec"]


@dataclass(frozen=True)
class MlaSpec:
    """The widths of one MLA block (transformers' DeepseekV3Attention)."""

    kv_lora_rank: int
    """Width of the compressed key/value latent (``kv_lora_rank``)."""
    qk_head_dim: int
    """Q and K width per head: ``qk_nope_head_dim + qk_rope_head_dim``."""
    v_head_dim: int
    """V width per head (``v_head_dim``)."""
    rope_head_dim: int
    """The decoupled RoPE key width shared by the heads (``qk_rope_head_dim``)."""
    q_lora_rank: int = 0
    """Width of the query latent (``q_lora_rank``); 0: queries are projected directly (``q_proj``)."""

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim", "rope_head_dim"):
            check_positive_int(name, getattr(self, name), maximum=10**6)
        q = self.q_lora_rank
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise SpecError(f"q_lora_rank={q!r} is not valid; give a whole number >= 0 (0: no query latent)")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MlaSpec":
        return cls(**data)
