"""A plain DeepSpeed script that fine-tunes a small Llama with peft LoRA (its own argparse and loop).

    deepspeed examples/train_deepspeed_lora.py --deepspeed_config ds.json --rank 8
    zeroplan probe examples/train_deepspeed_lora.py --config ds.json --gpus 2 -- --rank 8

The probe reads trainable and frozen parameter counts from the engine's module (requires_grad),
so the estimate beside it counts gradients and optimizer states for the adapters only. Model and
adapter flags are those of examples/lora_task.py (--layers --hidden --heads --kv-heads --ffn
--vocab --seq-len --rank --targets); --write-config PATH writes the base model's config.json
(for ``zeroplan probe ... --model PATH``) and exits.
"""

from __future__ import annotations

import argparse
import json
import sys

from lora_task import build_model, hf_config, lm_loss, make_batch, parse_args as model_args


def main() -> None:
    p = argparse.ArgumentParser(description="Fine-tune a small Llama with LoRA under DeepSpeed")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--write-config", default=None)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    args, _ = p.parse_known_args()
    margs = model_args(sys.argv[1:])
    if args.write_config:
        with open(args.write_config, "w") as fh:
            json.dump(hf_config(margs), fh)
        return

    import deepspeed
    import torch

    p = deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    args, _ = p.parse_known_args()
    deepspeed.init_distributed()
    model = build_model(margs)
    trainable = [q for q in model.parameters() if q.requires_grad]
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=trainable)
    rank = torch.distributed.get_rank()
    micro = 0
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            x, y = make_batch(margs, engine.train_micro_batch_size_per_gpu(), micro, rank)
            loss = lm_loss(engine, (x.to(engine.device), y.to(engine.device)))
            engine.backward(loss)
            engine.step()
            micro += 1
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
