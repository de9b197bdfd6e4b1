"""A small GPT as a zeroplan task: ``zeroplan probe examples/gpt_task.py --stage 3 --gpus 2``.

Defaults run on two CPU cores in seconds; scale with flags (after ``--`` on the zeroplan command
line) or environment variables: --layers/GPT_LAYERS, --hidden/GPT_HIDDEN, --heads/GPT_HEADS,
--vocab/GPT_VOCAB, --seq-len/GPT_SEQ_LEN.

The architecture is GPT-2's (pre-LayerNorm blocks, GELU MLP of width 4h, learned positions,
output projection tied to the token embedding), so its ``ModelSpec`` is exact for the estimator.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 512
    seq_len: int = 64


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.out = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        for module in self.modules():  # GPT-2's initialisation: N(0, 0.02), zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def parse_config(argv: list[str] | None = None) -> GPTConfig:
    """Sizes from flags, then GPT_* environment variables, then the tiny defaults."""
    d = GPTConfig()
    env = lambda name, default: int(os.environ.get(name, default))  # noqa: E731
    p = argparse.ArgumentParser(description="Small GPT sizes", add_help=False)
    p.add_argument("--layers", type=int, default=env("GPT_LAYERS", d.layers))
    p.add_argument("--hidden", type=int, default=env("GPT_HIDDEN", d.hidden))
    p.add_argument("--heads", type=int, default=env("GPT_HEADS", d.heads))
    p.add_argument("--vocab", type=int, default=env("GPT_VOCAB", d.vocab))
    p.add_argument("--seq-len", type=int, default=env("GPT_SEQ_LEN", d.seq_len))
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    return GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)


def make_batch(cfg: GPTConfig, micro_batch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens, reproducible per (step, rank): inputs and next-token targets."""
    gen = torch.Generator().manual_seed(step * 100_003 + rank)
    tokens = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 as training code usually does."""
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def model_spec(cfg: GPTConfig):
    """The estimator's view of this model, with the parameter count of the real module."""
    from zeroplan.spec import ModelSpec

    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg).parameters())
    return ModelSpec(
        name=f"gpt_task L{cfg.layers} h{cfg.hidden}",
        params=params,
        hidden_size=cfg.hidden,
        num_layers=cfg.layers,
        num_heads=cfg.heads,
        num_kv_heads=cfg.heads,
        ffn_size=4 * cfg.hidden,
        vocab_size=cfg.vocab,
        tied_embeddings=True,
        dropout=False,  # no nn.Dropout anywhere: autograd saves no masks
        fused_qkv=True,  # Block.qkv: one h×3h Linear
        source="given",
    )


def zeroplan_task():
    from zeroplan.runtime.rank.task import Task

    cfg = parse_config()
    return Task(
        build_model=lambda: GPT(cfg),
        make_batch=lambda micro_batch, step, rank: make_batch(cfg, micro_batch, step, rank),
        loss_fn=lm_loss,
        seq_len=cfg.seq_len,
        blocks=lambda model: list(model.blocks),
        model_spec=model_spec(cfg),
        lr=1e-3,
        loss="plain",  # lm_loss: fp32 cross-entropy, the logits dropped when forward returns
    )
