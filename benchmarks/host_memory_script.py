"""A DeepSpeed script for the host-memory benchmark: the GPT of examples/gpt_task.py, built
plainly in fp32 or under ``deepspeed.zero.Init`` (``--zero-init``), trained until stopped.

    deepspeed benchmarks/host_memory_script.py --deepspeed_config ds.json [--zero-init]
    torchrun ... benchmarks/host_memory_script.py --deepspeed_config ds.json --bare-steps 8   # times itself
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--zero-init", action="store_true")
    p.add_argument("--bare-steps", type=int, default=0, help="run alone: time this many steps after --bare-warmup, print them, exit")
    p.add_argument("--bare-warmup", type=int, default=2)
    p.add_argument("--local_rank", type=int, default=-1)
    p = deepspeed.add_config_arguments(p)
    args = p.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
    if args.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config):
            model = GPT(cfg)
    else:
        model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters())
    rank = torch.distributed.get_rank()
    step = 0
    times: list[float] = []
    cpu_times: list[float] = []
    last = last_cpu = None
    while True:
        x, y = make_batch(cfg, engine.train_micro_batch_size_per_gpu(), step, rank)
        loss = lm_loss(engine, (x, y))
        engine.backward(loss)
        engine.step()
        step += 1
        if args.bare_steps:
            # The same points a probe times: from one optimizer step's end to the next.
            now, cpu_now = time.perf_counter(), time.process_time()
            if step > args.bare_warmup and last is not None:
                times.append(now - last)
                cpu_times.append(cpu_now - last_cpu)
            last, last_cpu = now, cpu_now
            if len(times) >= args.bare_steps:
                # One write per line (atomic below PIPE_BUF): both ranks share torchrun's stdout.
                sys.stdout.write("BARE_STEP_TIMES " + json.dumps({"rank": rank, "step_times": times, "step_cpu_times": cpu_times}) + "\n")
                sys.stdout.flush()
                return


if __name__ == "__main__":
    main()
