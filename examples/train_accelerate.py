"""An accelerate training loop with a DeepSpeed plugin, as people write them: ``Accelerator``,
``prepare``, ``accelerator.backward``. A tiny Llama from a LlamaConfig with random weights and
random tokens: no hub access. The DeepSpeed config comes in as ``--deepspeed_config PATH`` (the
plugin's ``hf_ds_config``); the DataLoader uses its micro-batch.

    torchrun --nproc_per_node 2 examples/train_accelerate.py --deepspeed_config ds.json
    accelerate launch --config_file accelerate.yaml examples/train_accelerate.py --deepspeed_config ds.json
    zeroplan probe examples/train_accelerate.py --config ds.json --gpus 2
    zeroplan tune examples/train_accelerate.py --gpus 2
"""

from __future__ import annotations

import argparse
import json

import torch
from accelerate import Accelerator, DeepSpeedPlugin
from transformers import LlamaConfig, LlamaForCausalLM


class RandomTokens(torch.utils.data.Dataset):
    """Random token sequences, made on demand and reproducible per index."""

    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        self.samples, self.seq_len, self.vocab = samples, seq_len, vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(index))


def main() -> None:
    p = argparse.ArgumentParser(description="Train a tiny Llama with accelerate + DeepSpeed")
    p.add_argument("--deepspeed_config", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--steps", type=int, default=10_000, help="optimizer steps")
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args()
    with open(args.deepspeed_config) as f:
        ds = json.load(f)
    micro = ds.get("train_micro_batch_size_per_gpu")
    micro = micro if isinstance(micro, int) else 1
    accumulation = ds.get("gradient_accumulation_steps")
    accumulation = accumulation if isinstance(accumulation, int) else 1
    accelerator = Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=args.deepspeed_config), gradient_accumulation_steps=accumulation
    )
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=176, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.seq_len)
    model = LlamaForCausalLM(config)
    loader = torch.utils.data.DataLoader(RandomTokens(100_000, args.seq_len, args.vocab), batch_size=micro, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if "optimizer" not in ds else None
    if optimizer is None:
        from accelerate.utils import DummyOptim

        optimizer = DummyOptim(model.parameters())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    for step, ids in enumerate(loader):
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step // accumulation >= args.steps:
            break


if __name__ == "__main__":
    main()
