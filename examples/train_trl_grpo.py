"""A TRL GRPOTrainer script as people write them: HfArgumentParser over GRPOConfig, DeepSpeed through
``--deepspeed CONFIG``, a reward function of the completions. The policy is the tiny Llama of
``tiny_llama.json`` with random weights, loaded by path (GRPOTrainer builds its reference model
from that path when ``--beta`` is not 0). Completions come from the policy's own ``generate``
(no vLLM); prompts are ``prompt_len`` random words.

    torchrun --nproc_per_node 2 examples/train_trl_grpo.py --deepspeed ds.json --use_cpu --output_dir /tmp/grpo \
        --num_generations 2 --max_completion_length 16 --per_device_train_batch_size 2
    zeroplan probe examples/train_trl_grpo.py --config ds.json --gpus 2 -- --use_cpu --output_dir /tmp/grpo \
        --num_generations 2 --max_completion_length 16
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from datasets import Dataset
from transformers import HfArgumentParser
from trl import GRPOConfig, GRPOTrainer

from tiny_llama import CONFIG_JSON, save_tiny_llama, words


@dataclass
class DataArguments:
    config_json: str = str(CONFIG_JSON)
    prompt_len: int = 24
    samples: int = 2048


def even_tokens(completions: list[str], **kwargs) -> list[float]:
    """Reward: the share of a completion's words that are even-numbered tokens."""
    scores = []
    for text in completions:
        ids = [w[1:] for w in text.split() if w[1:].isdigit()]
        scores.append(sum(int(i) % 2 == 0 for i in ids) / len(ids) if ids else 0.0)
    return scores


def main() -> None:
    data_args, grpo_args = HfArgumentParser((DataArguments, GRPOConfig)).parse_args_into_dataclasses()
    path, tokenizer = save_tiny_llama(grpo_args, data_args.config_json)
    rng = random.Random(0)
    dataset = Dataset.from_list([{"prompt": words(rng, data_args.prompt_len, tokenizer.vocab_size)} for _ in range(data_args.samples)])
    GRPOTrainer(model=path, reward_funcs=even_tokens, args=grpo_args, train_dataset=dataset, processing_class=tokenizer).train()


if __name__ == "__main__":
    main()
