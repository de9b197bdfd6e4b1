"""Which parameters ZeRO-3 holds gathered when the loss's backward starts, on CPU ranks.

    PYTHONPATH=. DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 \
        benchmarks/zero3_gathered_params.py -- --rank 8 --targets all-linear

Runs examples/lora_task.py's model (``--rank 0``: fully fine-tuned) under DeepSpeed stage 3
with the config ``zeroplan export`` writes, for three steps (the parameter trace is recorded in
the first and complete from the second), and prints on rank 0, when the gradient reaches the
fp32 logits, the parameters by ``ds_status`` (AVAILABLE: gathered; NOT_AVAILABLE: only the
partition), trainable or frozen, persistent or not, with their 16-bit MiB, then the names of
the gathered-then-released frozen ones. zeroplan.estimator.peft.stage3_released_frozen_params
models the NOT_AVAILABLE frozen set.
"""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    import lora_task
    from zeroplan.dsconfig import build_config
    from zeroplan.spec import Plan, TrainingSpec

    args = lora_task.parse_args([a for a in sys.argv[1:] if a != "--"])
    deepspeed.init_distributed(dist_backend="gloo")
    config = build_config(Plan(micro_batch=2, stage=3), world_size=dist.get_world_size(),
                          training=TrainingSpec(precision="bf16", seq_len=args.seq_len), model=lora_task.model_spec(args))
    model = lora_task.build_model(args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
    rank = dist.get_rank()

    def dump(step: int) -> None:
        if rank or step < 2:
            return
        numel: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        released = []
        for name, p in engine.module.named_parameters():
            status = str(p.ds_status).split(".")[-1]
            key = (status, "trainable" if p.requires_grad else "frozen", "persistent" if p.ds_persist else "partitioned")
            numel[key] += p.ds_numel
            count[key] += 1
            if status == "NOT_AVAILABLE" and not p.requires_grad:
                released.append(f"{name} ({p.ds_numel:,})")
        print(f"step {step}, gradient at the fp32 logits; ds_status of every parameter (16-bit MiB):")
        for key in sorted(numel):
            print(f"  {' '.join(key):45s} {count[key]:4d} tensors {numel[key]:>12,} elements {2 * numel[key] / 2**20:8.2f} MiB")
        print("frozen, not gathered:", ", ".join(released) or "none")

    for step in range(3):
        x, y = lora_task.make_batch(args, 2, step, rank)
        logits = engine(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        logits.register_hook(lambda g, s=step: dump(s))
        del logits
        engine.backward(loss)
        del loss
        engine.step()
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip engine teardown (gloo threads), as zeroplan.runtime.rank.worker does


if __name__ == "__main__":
    sys.exit(main())
