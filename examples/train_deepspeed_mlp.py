"""A plain DeepSpeed script whose model is not a transformer: a stack of Linear layers.

    deepspeed examples/train_deepspeed_mlp.py --deepspeed_config ds.json
    zeroplan probe examples/train_deepspeed_mlp.py --config ds.json --gpus 2

Eight 1024 × 1024 Linear layers without bias (8,388,608 parameters) with ReLU between them,
regressing 1024 random features onto a random target with a mean-squared-error loss. Nothing in it
knows zeroplan: its own argparse, DeepSpeed's config arguments and its own loop.
"""

from __future__ import annotations

import argparse

import deepspeed
import torch
import torch.nn as nn


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a Linear stack with DeepSpeed")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p = deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    return p.parse_args()


def build_model(layers: int, width: int) -> nn.Module:
    stack: list[nn.Module] = []
    for i in range(layers):
        stack.append(nn.Linear(width, width, bias=False))
        if i < layers - 1:
            stack.append(nn.ReLU())
    return nn.Sequential(*stack)


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    model = build_model(args.layers, args.width)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(rank)
    dtype = next(engine.module.parameters()).dtype
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            micro = engine.train_micro_batch_size_per_gpu()
            x = torch.randn(micro, args.width, generator=generator).to(engine.device, dtype)
            target = torch.randn(micro, args.width, generator=generator).to(engine.device, dtype)
            loss = nn.functional.mse_loss(engine(x).float(), target.float())
            engine.backward(loss)
            engine.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
