"""A plain DeepSpeed loop over a Hugging Face causal LM built from a config.json with random
weights (no hub access): ``engine(input_ids=..., labels=...).loss``, as people write them.

    deepspeed examples/train_hf_causal_lm.py --deepspeed_config ds.json
    zeroplan probe examples/train_hf_causal_lm.py --config ds.json --gpus 2 --sp 2

The script knows nothing of sequence or tensor parallelism: ``zeroplan probe --sp/--tp`` runs it
with that layout (zeroplan.runtime.rank.layout). Sizes: --model-config DIR (a folder with
config.json, default examples/tiny_llama), --seq-len, --attn (sdpa; eager is what Ulysses rejects).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a Hugging Face causal LM from config.json with DeepSpeed")
    p.add_argument("--model-config", default=str(Path(__file__).parent / "tiny_llama"), help="folder holding config.json")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--attn", default="sdpa", help="attn_implementation")
    p.add_argument("--tiled-mlp", action="store_true", help="ALST's TiledMLP: the MLP computed (and recomputed in backward) in tiles")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p = deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    return p.parse_args()


def use_tiled_mlp(config) -> None:
    """Patch the model family's MLP with DeepSpeed's TiledMLP, as ulysses_sp.py's TiledMLP docstring
    shows for LlamaMLP: ceil(seqlen / hidden) tiles, agreed across ranks (the max)."""
    import math

    import importlib

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    mlp_class = next(getattr(module, name) for name in dir(module) if name.endswith("MLP") and not name.startswith("_"))

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_forward(self, x):
        shards = torch.tensor(math.ceil(x.shape[-2] / x.shape[-1]))
        torch.distributed.all_reduce(shards, op=torch.distributed.ReduceOp.MAX)
        return TiledMLP.apply(mlp_forward, self, x, int(shards), [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])

    mlp_class.forward = tiled_forward


def main() -> None:
    args = parse_args()
    deepspeed.init_distributed()
    config = AutoConfig.from_pretrained(args.model_config)
    if args.tiled_mlp:
        use_tiled_mlp(config)
    torch.manual_seed(0)  # every rank builds the same weights
    model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank = torch.distributed.get_rank()
    micro = 0
    for step in range(args.steps):
        for _ in range(engine.gradient_accumulation_steps()):
            ids = torch.randint(0, config.vocab_size, (engine.train_micro_batch_size_per_gpu(), args.seq_len),
                                generator=torch.Generator().manual_seed(1000 * micro + rank))
            loss = engine(input_ids=ids.to(engine.device), labels=ids.to(engine.device)).loss
            engine.backward(loss)
            engine.step()
            micro += 1
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
