"""A Hugging Face Llama with random weights as a zeroplan task (for benchmarks/gpu_check.py).

Sizes from flags: --hidden, --layers, --heads, --kv-heads, --ffn, --vocab, --seq-len. The loss is
the model's own (``labels=``), so the logits are returned and held as in a Trainer run
(``--loss hf``). With ZEROPLAN_RESERVED_FILE set, each loss call writes
``torch.cuda.max_memory_reserved()`` there (the probe reports allocated bytes only).
"""

from __future__ import annotations

import argparse
import os
import sys


def parse(argv=None):
    p = argparse.ArgumentParser(add_help=False)
    for name, default in (("hidden", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8), ("ffn", 5632), ("vocab", 32000), ("seq-len", 1024)):
        p.add_argument(f"--{name}", type=int, default=default)
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, intermediate_size=args.ffn, vocab_size=args.vocab,
                       max_position_embeddings=max(2048, args.seq_len), tie_word_embeddings=False,
                       attn_implementation="sdpa", use_cache=False)


def model_spec(args):
    import torch
    from transformers import LlamaForCausalLM

    from zeroplan.spec import ModelSpec

    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(llama_config(args)).parameters())
    return ModelSpec(name=f"llama h{args.hidden} L{args.layers}", params=params, hidden_size=args.hidden, num_layers=args.layers,
                     num_heads=args.heads, num_kv_heads=args.kv_heads, ffn_size=args.ffn, vocab_size=args.vocab,
                     tied_embeddings=False, gated_mlp=True, source="given")


def zeroplan_task():
    import json

    import torch
    from transformers import LlamaForCausalLM

    from zeroplan.runtime.rank.task import Task

    args = parse()
    reserved_file = os.environ.get("ZEROPLAN_RESERVED_FILE")

    def build():
        torch.manual_seed(0)
        return LlamaForCausalLM(llama_config(args))

    def make_batch(micro_batch, step, rank):
        gen = torch.Generator().manual_seed(step * 1009 + rank)
        ids = torch.randint(0, args.vocab, (micro_batch, args.seq_len), generator=gen)
        return ids, ids.clone()

    def loss_fn(model, batch):
        ids, labels = batch
        out = model(input_ids=ids, labels=labels)
        if reserved_file and torch.cuda.is_available():
            with open(reserved_file, "w") as f:
                json.dump({"max_memory_reserved": torch.cuda.max_memory_reserved()}, f)
        return out.loss

    return Task(build_model=build, make_batch=make_batch, loss_fn=loss_fn, seq_len=args.seq_len,
                blocks=lambda m: list(m.model.layers), model_spec=model_spec(args), lr=1e-4)
