"""Bytes DeepSpeed's optimizer step allocates beyond the live state, by optimizer implementation
(example GPT task, CPU ranks, live tensor storage).

    PYTHONPATH=. python -m torch.distributed.run --nproc_per_node 2 \
        benchmarks/optimizer_step_memory.py --stage 2 --impl torch-loop

``--impl``: ``config`` (an ``optimizer`` block: DeepSpeed builds FusedAdam), ``torch-loop`` /
``torch-foreach`` (a client torch.optim.AdamW passed to ``deepspeed.initialize``, as Hugging
Face's Trainer does when the config has no ``optimizer`` block; the for-loop is torch's CPU
default, foreach its CUDA default). Prints one JSON line on rank 0: live bytes before the last
``engine.step()`` and the largest increase inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--impl", default="config", choices=("config", "torch-loop", "torch-foreach"))
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    import gpt_task
    from zeroplan.runtime.memory import StorageTracker

    cfg = gpt_task.GPTConfig(layers=4, hidden=256, heads=4, vocab=8192, seq_len=128)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": cfg.hidden**2},
        "zero_allow_untested_optimizer": True,
    }
    if args.impl == "config":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    tracker = StorageTracker()
    with tracker:
        model = gpt_task.GPT(cfg)
        client = {}
        if args.impl != "config":
            client["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=args.impl == "torch-foreach")
        engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, **client)
        rank = dist.get_rank()
        for step in range(args.steps):
            engine.backward(gpt_task.lm_loss(engine, gpt_task.make_batch(cfg, 2, step, rank)))
            before = tracker.current_bytes
            tracker.reset_peak()
            engine.step()
            step_extra = tracker.peak_bytes - before
    if rank == 0:
        inner = type(getattr(optimizer, "optimizer", optimizer)).__name__
        print(json.dumps({"stage": args.stage, "impl": args.impl, "optimizer": inner, "world_size": dist.get_world_size(),
                          "before_step_bytes": before, "step_extra_bytes": step_extra}))


if __name__ == "__main__":
    main()
