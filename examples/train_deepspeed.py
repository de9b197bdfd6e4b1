"""A plain DeepSpeed training script (its own argparse and loop), as users write them.

    deepspeed examples/train_deepspeed.py --deepspeed_config ds.json
    zeroplan probe examples/train_deepspeed.py --config ds.json --gpus 2

Model sizes: --layers --hidden --heads --vocab --seq-len (the GPT of examples/gpt_task.py).
"""

from __future__ import annotations

import argparse

import deepspeed
import torch

from gpt_task import GPT, GPTConfig, lm_loss, make_batch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small GPT with DeepSpeed")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p = deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    return p.parse_args()


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    cfg = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
    model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank = torch.distributed.get_rank()
    micro = 0
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = make_batch(cfg, engine.train_micro_batch_size_per_gpu(), micro, rank)
            loss = lm_loss(engine, (x.to(engine.device), y.to(engine.device)))
            engine.backward(loss)
            engine.step()
            micro += 1
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
