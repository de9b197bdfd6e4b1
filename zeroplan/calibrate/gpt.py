"""The built-in workload that measures transformer efficiency: a GPT-2-style decoder.

Pre-LayerNorm blocks, GELU MLP of width 4h, learned positions, tied output projection — the
layer Korthikanti et al. and the estimator's FLOP count (6·N + 12·L·h·s per token) describe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTShape", "GPT", "gpt_batch", "gpt_loss", "gpt_model_spec"]


@dataclass(frozen=True)
class GPTShape:
    """Sizes of the workload (a few million parameters: seconds per step on one CPU core)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 8192
    seq_len: int = 256

    @property
    def label(self) -> str:
        return f"L{self.layers} h{self.hidden} a{self.heads} V{self.vocab} s{self.seq_len}"


class _Block(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        h = shape.hidden
        self.heads = shape.heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, shape: GPTShape) -> None:
        super().__init__()
        self.tok = nn.Embedding(shape.vocab, shape.hidden)
        self.pos = nn.Embedding(shape.seq_len, shape.hidden)
        self.blocks = nn.ModuleList(_Block(shape) for _ in range(shape.layers))
        self.ln_f = nn.LayerNorm(shape.hidden)
        self.head = nn.Linear(shape.hidden, shape.vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_batch(shape: GPTShape, micro_batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, shape.vocab, (micro_batch, shape.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def gpt_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def gpt_model_spec(shape: GPTShape):
    from zeroplan.spec import ModelSpec

    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(shape).parameters())
    return ModelSpec(
        name=f"calibrate GPT {shape.label}", params=params, hidden_size=shape.hidden, num_layers=shape.layers,
        num_heads=shape.heads, num_kv_heads=shape.heads, ffn_size=4 * shape.hidden, vocab_size=shape.vocab,
        tied_embeddings=True, fused_qkv=True, source="given",
    )
