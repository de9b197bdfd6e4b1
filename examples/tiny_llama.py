"""The tiny Llama and the word-level tokenizer that the TRL preference and RL examples share.

A Hugging Face ``config.json`` (``tiny_llama.json`` beside this file) with random weights, saved
once into a local folder so that TRL can load it by path as it loads a hub id: DPOTrainer and
GRPOTrainer build their reference model from the policy's path
(trl/trainer/dpo_trainer.py and grpo_trainer.py, ``create_model_from_path(get_config_model_id(...))``).
No hub access. Tokens are the words ``t3`` … ``t{vocab-1}`` after ``<pad>``, ``</s>`` and ``<s>``.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainingArguments

CONFIG_JSON = Path(__file__).with_name("tiny_llama.json")


def tokenizer_for(vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: ``<pad>`` 0, ``</s>`` 1, ``<s>`` 2, then the words ``t3`` …
    ``t{vocab_size-1}`` (special tokens that no word contains: the tokenizer splits them out of any text)."""
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def save_tiny_llama(args: TrainingArguments, config_json: Path = CONFIG_JSON, *, seed: int = 0) -> tuple[str, PreTrainedTokenizerFast]:
    """Random weights for ``config_json``, saved (with the tokenizer) under ``args.output_dir`` by
    the main process first; returns the folder and the tokenizer."""
    config = LlamaConfig.from_json_file(str(config_json))
    tokenizer = tokenizer_for(config.vocab_size)
    folder = Path(args.output_dir) / "tiny-llama"
    with args.main_process_first(desc="tiny Llama weights"):
        if not (folder / "config.json").exists():
            torch.manual_seed(seed)
            LlamaForCausalLM(config).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
    if args.deepspeed and args.use_cpu:
        # On CPU accelerate starts torch.distributed but not DeepSpeed's comm (accelerate/state.py:
        # its DeepSpeed branch runs only ``if not cpu``), so ZeRO-3's zero.Init inside
        # from_pretrained would read a world size of 1 (deepspeed/runtime/config.py falls back to 1)
        # and refuse the batch. On GPUs accelerate has already done this.
        import deepspeed

        if not deepspeed.comm.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo")
    return str(folder), tokenizer


def words(rng: random.Random, n: int, vocab_size: int) -> str:
    """``n`` random tokens (never the pad, end or start token) as text."""
    return " ".join(f"t{rng.randrange(3, vocab_size)}" for _ in range(n))
