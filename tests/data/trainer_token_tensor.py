"""A Hugging Face Trainer script whose dataset is one tensor of token ids built before the model.

Written as people write them and unknown to zeroplan: HfArgumentParser over TrainingArguments, a
tiny Llama from a LlamaConfig, DeepSpeed through ``--deepspeed CONFIG`` (an all-"auto" ZeRO-2
config, tests/data/configs/zero2_auto.json). The corpus — 100,000 samples of 128 int64 token
ids, 102.4 MB — sits in host memory on a GPU run; only the batches the Trainer moves to the
device, the model, the engine and the optimizer would be device memory.

    torchrun --nproc_per_node 2 tests/data/trainer_token_tensor.py --deepspeed tests/data/configs/zero2_auto.json --use_cpu
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


@dataclass
class DataArguments:
    samples: int = 100_000
    seq_len: int = 128
    vocab: int = 512


class TokenTensor(torch.utils.data.Dataset):
    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, index: int) -> dict:
        row = self.ids[index]
        return {"input_ids": row, "labels": row}


def main() -> None:
    data_args, training_args = HfArgumentParser((DataArguments, TrainingArguments)).parse_args_into_dataclasses()
    ids = torch.randint(0, data_args.vocab, (data_args.samples, data_args.seq_len), generator=torch.Generator().manual_seed(0))
    config = LlamaConfig(
        vocab_size=data_args.vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=data_args.seq_len,
    )
    model = LlamaForCausalLM(config)
    Trainer(model=model, args=training_args, train_dataset=TokenTensor(ids)).train()


if __name__ == "__main__":
    main()
