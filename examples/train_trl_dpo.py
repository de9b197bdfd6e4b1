"""A TRL DPOTrainer script as people write them: HfArgumentParser over DPOConfig, DeepSpeed through
``--deepspeed CONFIG``. The policy is the tiny Llama of ``tiny_llama.json`` with random weights,
loaded by path, so DPOTrainer builds its reference model from the same path and prepares it for
DeepSpeed as it does for any model (trl/models/utils.py ``prepare_deepspeed``: the policy's stage
under ZeRO-3, stage 0 otherwise). An in-memory preference set of random words: every prompt has
``prompt_len`` tokens and every chosen and rejected answer ``completion_len``.

    torchrun --nproc_per_node 2 examples/train_trl_dpo.py --deepspeed ds.json --use_cpu --output_dir /tmp/dpo
    zeroplan probe examples/train_trl_dpo.py --config ds.json --gpus 2 -- --use_cpu --output_dir /tmp/dpo
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset
from transformers import HfArgumentParser
from trl import DPOConfig, DPOTrainer

from tiny_llama import CONFIG_JSON, save_tiny_llama, words


@dataclass
class DataArguments:
    config_json: str = str(CONFIG_JSON)
    prompt_len: int = 24
    completion_len: int = 24
    samples: int = 2048


def main() -> None:
    data_args, dpo_args = HfArgumentParser((DataArguments, DPOConfig)).parse_args_into_dataclasses()
    path, tokenizer = save_tiny_llama(dpo_args, data_args.config_json)
    rng = random.Random(0)
    vocab = tokenizer.vocab_size
    # DPOTrainer tokenizes prompt + answer as one string (trl/trainer/dpo_trainer.py tokenize_fn), so
    # answers start with the space that separates them from the prompt, as in real preference sets.
    rows = [
        {"prompt": words(rng, data_args.prompt_len, vocab), "chosen": " " + words(rng, data_args.completion_len, vocab),
         "rejected": " " + words(rng, data_args.completion_len, vocab)}
        for _ in range(data_args.samples)
    ]
    dataset = Dataset.from_list(rows)
    DPOTrainer(model=path, args=dpo_args, train_dataset=dataset, processing_class=tokenizer).train()


if __name__ == "__main__":
    main()
