"""A small Llama with LoRA adapters as a zeroplan task (random weights, built from a config).

    zeroplan probe examples/lora_task.py --stage 2 --gpus 2 -- --rank 8 --targets q_proj,v_proj

Flags after ``--`` (or LORA_* environment variables): --layers, --hidden, --heads, --kv-heads,
--ffn, --vocab, --seq-len, --rank (0: full fine-tune of the same model), --targets
(comma-separated module names or all-linear), --base-quant nf4 (QLoRA: the random base saved and
reloaded in NF4 by transformers with bitsandbytes). Needs transformers and peft.

The base is frozen by ``peft.get_peft_model`` (requires_grad False), so DeepSpeed builds
gradients and optimizer states for the adapters only. The task's ``model_spec`` carries the
exact LoRA count from :mod:`zeroplan.profiles.lora`, which the estimate beside the probe uses.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = lambda name, default: os.environ.get(f"LORA_{name}", default)  # noqa: E731
    p = argparse.ArgumentParser(description="Small Llama + LoRA sizes", add_help=False)
    p.add_argument("--layers", type=int, default=int(env("LAYERS", 4)))
    p.add_argument("--hidden", type=int, default=int(env("HIDDEN", 256)))
    p.add_argument("--heads", type=int, default=int(env("HEADS", 4)))
    p.add_argument("--kv-heads", type=int, default=int(env("KV_HEADS", 2)))
    p.add_argument("--ffn", type=int, default=int(env("FFN", 688)))
    p.add_argument("--vocab", type=int, default=int(env("VOCAB", 8192)))
    p.add_argument("--seq-len", type=int, default=int(env("SEQ_LEN", 128)))
    p.add_argument("--rank", type=int, default=int(env("RANK_R", 8)))
    p.add_argument("--targets", default=env("TARGETS", "q_proj,v_proj"))
    p.add_argument("--base-quant", default=env("BASE_QUANT", "none"), choices=("none", "nf4"))
    args, _ = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    return args


def hf_config(args: argparse.Namespace) -> dict:
    """The Hugging Face config of the base model (what ``config.json`` would hold)."""
    return dict(
        model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )


def _targets(args: argparse.Namespace):
    return "all-linear" if args.targets == "all-linear" else args.targets.split(",")


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    data = hf_config(args)
    config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    import peft

    if args.rank and args.base_quant == "nf4":
        model = _nf4_base(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    if args.rank == 0:
        return model
    return peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=_targets(args)))


def _nf4_base(config) -> torch.nn.Module:
    """Random weights saved in bf16 and loaded as QLoRA loads a checkpoint: NF4 with double
    quantization, bf16 compute (transformers' bitsandbytes integration keeps lm_head
    unquantized), then peft's prepare_model_for_kbit_training (non-quantized parameters to fp32;
    no checkpointing here: the plan's checkpointing applies). The random model is dropped before
    loading, so the build holds what a load from a real checkpoint holds, not both copies."""
    import gc
    import tempfile
    import warnings

    import peft
    import transformers

    quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                            bnb_4bit_compute_dtype=torch.bfloat16)
    device_map = {"": int(os.environ.get("LOCAL_RANK", 0))} if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory(prefix="lora-task-") as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Every rank writes its own copy (save_pretrained writes on rank 0 only once
        # torch.distributed is up).
        from safetensors.torch import save_file

        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.config.to_json_file(os.path.join(folder, "config.json"))
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        del model
        gc.collect()
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=torch.bfloat16,
                                                                  device_map=device_map)
    return peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def make_batch(args: argparse.Namespace, micro_batch: int, step: int, rank: int):
    gen = torch.Generator().manual_seed(step * 100_003 + rank)
    tokens = torch.randint(0, args.vocab, (micro_batch, args.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def lm_loss(model, batch) -> torch.Tensor:
    """Next-token cross-entropy in fp32; the logits are dropped when the loss is returned."""
    x, y = batch
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def model_spec(args: argparse.Namespace):
    """Exact counts: the base from its config, LoRA from the targets (zeroplan.profiles.lora)."""
    from dataclasses import replace

    from zeroplan.profiles.hf_config import model_from_hf_dict
    from zeroplan.profiles.lora import base_modules, lora_spec

    data = hf_config(args)
    base = model_from_hf_dict(data, name=f"llama L{args.layers} h{args.hidden}")
    if args.rank == 0:
        return base
    peft_spec = lora_spec(base, base_modules(data), rank=args.rank, targets=_targets(args), alpha=2 * args.rank,
                          base_quant=args.base_quant)
    return replace(base, name=f"{base.name} + LoRA r{args.rank}", peft=peft_spec)


def blocks(model) -> list:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return list(inner.model.layers)


def zeroplan_task():
    from zeroplan.runtime.rank.task import Task

    args = parse_args()
    return Task(
        build_model=lambda: build_model(args),
        make_batch=lambda micro_batch, step, rank: make_batch(args, micro_batch, step, rank),
        loss_fn=lm_loss,
        seq_len=args.seq_len,
        blocks=blocks,
        model_spec=model_spec(args),
        lr=1e-3,
    )
