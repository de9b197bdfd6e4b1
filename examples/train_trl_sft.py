"""A TRL SFTTrainer script as people write them: HfArgumentParser over SFTConfig, DeepSpeed through
``--deepspeed CONFIG``. A tiny Llama from a LlamaConfig with random weights, an in-memory word-level
tokenizer and pre-tokenized random sequences: no hub access, runs on CPU with ``--use_cpu``.

    torchrun --nproc_per_node 2 examples/train_trl_sft.py --deepspeed ds.json --use_cpu
    zeroplan probe examples/train_trl_sft.py --config ds.json --gpus 2 -- --use_cpu
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer


@dataclass
class ModelArguments:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 176
    vocab: int = 512
    seq_len: int = 64
    samples: int = 4096


def main() -> None:
    model_args, sft_args = HfArgumentParser((ModelArguments, SFTConfig)).parse_args_into_dataclasses()
    vocab = {f"t{i}": i for i in range(model_args.vocab)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")), pad_token="t0", eos_token="t1"
    )
    config = LlamaConfig(
        vocab_size=model_args.vocab,
        hidden_size=model_args.hidden,
        intermediate_size=model_args.ffn,
        num_hidden_layers=model_args.layers,
        num_attention_heads=model_args.heads,
        num_key_value_heads=model_args.kv_heads,
        max_position_embeddings=model_args.seq_len,
        pad_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, model_args.vocab, (model_args.samples, model_args.seq_len), generator=gen).tolist()
    dataset = Dataset.from_dict({"input_ids": ids})
    SFTTrainer(model=model, args=sft_args, train_dataset=dataset, processing_class=tokenizer).train()


if __name__ == "__main__":
    main()
