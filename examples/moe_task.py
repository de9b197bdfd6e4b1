"""Mixture-of-experts models as zeroplan tasks, small enough for CPU ranks:

    zeroplan probe examples/moe_task.py --stage 3 --gpus 2            # tiny Qwen3-MoE (fused experts)
    zeroplan probe examples/moe_task.py --stage 3 --gpus 2 -- --list  # hand-written ModuleList experts

Default: the Qwen3-MoE of ``examples/qwen3_moe_tiny.json`` (or ``--config PATH``/MOE_CONFIG) built
by transformers with random weights — transformers 5 stores each layer's experts as fused 3-D
parameters. ``--list`` (MOE_LIST=1): a block of the same shape whose experts are an
``nn.ModuleList`` of MLPs (as transformers 4.x and remote-code models have them), which ZeRO-3
needs as a leaf module (``zero_optimization.leaf_module``; validate rule ZP250).
Sizes: --seq-len/MOE_SEQ_LEN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Tiny MoE task", add_help=False)
    p.add_argument("--config", default=os.environ.get("MOE_CONFIG", str(HERE / "qwen3_moe_tiny.json")))
    p.add_argument("--list", action="store_true", default=os.environ.get("MOE_LIST") == "1")
    p.add_argument("--seq-len", type=int, default=int(os.environ.get("MOE_SEQ_LEN", 64)))
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args


class ExpertMLP(nn.Module):
    """One SwiGLU expert (transformers 4.x ``Qwen3MoeMLP``)."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.up_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ListMoeBlock(nn.Module):
    """Top-k routing over an ``nn.ModuleList`` of experts; only the experts some token picked run
    (transformers 4.x ``Qwen3MoeSparseMoeBlock.forward``), so which experts' parameters a rank
    touches depends on its tokens."""

    def __init__(self, hidden: int, inner: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(hidden, inner) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token, slot = torch.where(chosen == e)
            out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out.reshape(shape)


def _config(path: str) -> dict:
    return json.loads(Path(path).read_text())


def build_model(args: argparse.Namespace) -> nn.Module:
    import transformers

    data = _config(args.config)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if args.list:
        for layer in model.model.layers:
            layer.mlp = ListMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                     config.num_experts_per_tok)
    return model


def make_batch(vocab: int, seq_len: int, micro_batch: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step * 100_003 + rank)
    tokens = torch.randint(0, vocab, (micro_batch, seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """fp32 next-token cross-entropy; the output object (and its logits) is dropped on return."""
    x, y = batch
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def model_spec(args: argparse.Namespace):
    """The estimator's view: the config.json counted by zeroplan (exact for fused experts); the
    ModuleList variant has the same parameters, stored per expert, and needs leaf modules."""
    import dataclasses

    from zeroplan.profiles import model_from_hf_config

    spec = model_from_hf_config(args.config)
    if args.list:
        leaf = (f"{ListMoeBlock.__module__}.{ListMoeBlock.__qualname__}",)
        spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, fused_experts=False, leaf_module_classes=leaf))
    return dataclasses.replace(spec, name=f"moe_task {'list' if args.list else 'fused'}", source="given", dropout=False)


def zeroplan_task():
    from zeroplan.runtime.rank.task import Task

    args = parse_args()
    vocab = _config(args.config)["vocab_size"]
    return Task(
        build_model=lambda: build_model(args),
        make_batch=lambda micro_batch, step, rank: make_batch(vocab, args.seq_len, micro_batch, step, rank),
        loss_fn=lm_loss,
        seq_len=args.seq_len,
        blocks=lambda model: list(model.model.layers),
        model_spec=model_spec(args),
        lr=1e-3,
        loss="plain",
    )
