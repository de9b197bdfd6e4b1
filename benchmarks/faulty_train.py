"""A plain DeepSpeed script that misbehaves the way real ones do (for bench_tuner_faults.py).

The example GPT (examples/gpt_task.py), trained like examples/train_deepspeed.py, except:

* ``--crash-stage S``: under ZeRO stage S it raises before ``deepspeed.initialize`` (a start-up
  crash that does not depend on the micro-batch); -1: never;
* ``--hang-micro-batch K``: at micro-batch >= K every rank sleeps in its first forward (a hang
  before the first optimizer step); 0: never;
* ``--slow-accumulation G --slow-micro-step-s T``: at gradient accumulation >= G every
  micro-step takes T seconds longer (a slow plan that works, but whose probe is long);
* ``--crash-always``: raises the same error at start-up whatever the plan;
* ``--oom-stage S --oom-micro-batch K``: under ZeRO stage S at micro-batch >= K the first forward
  raises torch's out-of-memory error (what a device that is too small says), every other plan works.

    zeroplan tune benchmarks/faulty_train.py --gpus 2 --params 137e3 --global-batch 32 -- --crash-stage 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import deepspeed
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt_task import GPT, GPTConfig, lm_loss, make_batch  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A faulty small-GPT DeepSpeed script")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (the probe stops it earlier)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--crash-stage", type=int, default=3)
    p.add_argument("--hang-micro-batch", type=int, default=16)
    p.add_argument("--slow-accumulation", type=int, default=0)
    p.add_argument("--slow-micro-step-s", type=float, default=0.0)
    p.add_argument("--crash-always", action="store_true")
    p.add_argument("--oom-stage", type=int, default=-1)
    p.add_argument("--oom-micro-batch", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    config = json.loads(Path(args.deepspeed_config).read_text())
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    if args.crash_always:
        raise ImportError("cannot import name 'fused_rope' from 'mylib.kernels' (/opt/env/lib/mylib/kernels.py)")
    if stage == args.crash_stage:
        raise RuntimeError(f"partitioned parameter layout not supported by this model at ZeRO-{stage}")
    deepspeed.init_distributed()
    cfg = GPTConfig(layers=args.layers)
    model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank = torch.distributed.get_rank()
    micro_batch = engine.train_micro_batch_size_per_gpu()
    accumulation = engine.gradient_accumulation_steps()
    micro = 0
    for _ in range(args.steps):
        for _ in range(accumulation):
            if args.hang_micro_batch and micro_batch >= args.hang_micro_batch:
                time.sleep(10**6)
            if stage == args.oom_stage and args.oom_micro_batch and micro_batch >= args.oom_micro_batch:
                raise torch.OutOfMemoryError(
                    f"CUDA out of memory. Tried to allocate {micro_batch * 8} MiB (micro-batch {micro_batch} at ZeRO-{stage})"
                )
            if args.slow_accumulation and accumulation >= args.slow_accumulation:
                time.sleep(args.slow_micro_step_s)
            x, y = make_batch(cfg, micro_batch, micro, rank)
            loss = lm_loss(engine, (x.to(engine.device), y.to(engine.device)))
            engine.backward(loss)
            engine.step()
            micro += 1


if __name__ == "__main__":
    main()
