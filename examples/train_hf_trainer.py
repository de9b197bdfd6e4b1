"""A Hugging Face Trainer script as people write them: HfArgumentParser over TrainingArguments,
DeepSpeed through ``--deepspeed CONFIG``. A tiny Llama built from a LlamaConfig with random
weights and random tokens: no hub access, runs on CPU with ``--use_cpu``.

    torchrun --nproc_per_node 2 examples/train_hf_trainer.py --deepspeed ds.json --use_cpu
    zeroplan probe examples/train_hf_trainer.py --config ds.json --gpus 2 -- --use_cpu
    zeroplan tune examples/train_hf_trainer.py --gpus 2 -- --use_cpu

Model sizes: --layers --hidden --heads --kv_heads --ffn --vocab --seq_len (all Trainer flags work too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


@dataclass
class ModelArguments:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 176
    vocab: int = 512
    seq_len: int = 64
    samples: int = 100_000


class RandomTokens(torch.utils.data.Dataset):
    """Random token sequences, reproducible per index; labels are the inputs (causal LM)."""

    def __init__(self, samples: int, seq_len: int, vocab: int) -> None:
        self.samples, self.seq_len, self.vocab = samples, seq_len, vocab

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> dict:
        ids = torch.randint(0, self.vocab, (self.seq_len,), generator=torch.Generator().manual_seed(index))
        # position_ids: Ulysses sequence parallelism shards them with the tokens (accelerate's
        # UlyssesSPDataLoaderAdapter requires them); without sp they are the positions Llama uses anyway.
        return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(self.seq_len)}


def main() -> None:
    model_args, training_args = HfArgumentParser((ModelArguments, TrainingArguments)).parse_args_into_dataclasses()
    config = LlamaConfig(
        vocab_size=model_args.vocab,
        hidden_size=model_args.hidden,
        intermediate_size=model_args.ffn,
        num_hidden_layers=model_args.layers,
        num_attention_heads=model_args.heads,
        num_key_value_heads=model_args.kv_heads,
        max_position_embeddings=model_args.seq_len,
    )
    torch.manual_seed(training_args.seed)  # the same weights on every run (runs of two layouts compare)
    model = LlamaForCausalLM(config)
    dataset = RandomTokens(model_args.samples, model_args.seq_len, model_args.vocab)
    Trainer(model=model, args=training_args, train_dataset=dataset).train()


if __name__ == "__main__":
    main()
