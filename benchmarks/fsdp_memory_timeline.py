"""Live tensor bytes through FSDP2 training steps on CPU ranks (example GPT task), by phase.

    PYTHONPATH=. python -m torch.distributed.run --nproc_per_node 2 \
        benchmarks/fsdp_memory_timeline.py --stage 3 [--checkpointing full] [--offload] [--foreach]

Wraps the model exactly as the probe's fsdp backend does (zeroplan.runtime.rank.backends.fsdp.wrap_model:
FSDP2 ``fully_shard`` per block and at the root, bf16 MixedPrecisionPolicy with fp32 reduction),
counts live tensor storage with zeroplan.runtime.measure.memory.StorageTracker (the probes' CPU meter), and
prints on rank 0, for the last step, the largest live MiB in each window: forward, the loss's
backward (until the gradient reaches the logits), each block's backward, the rest of backward,
and the optimizer step. ``--foreach`` makes AdamW use its foreach implementation (the CUDA default);
the CPU default is the single-tensor loop.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

MIB = 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=3, choices=(2, 3))
    p.add_argument("--checkpointing", default="none", choices=("none", "full"))
    p.add_argument("--offload", action="store_true")
    p.add_argument("--foreach", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    import gpt_task
    from zeroplan.runtime.rank.backends.common import apply_checkpointing
    from zeroplan.runtime.rank.backends.fsdp import wrap_model
    from zeroplan.runtime.measure.memory import StorageTracker
    from zeroplan.spec import Plan

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = gpt_task.GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
    plan = Plan(stage=args.stage, checkpointing=args.checkpointing, offload_optimizer="cpu" if args.offload else "none",
                offload_param="cpu" if args.offload and args.stage == 3 else "none")
    windows: dict[str, int] = {}
    tracker = StorageTracker()

    def close(label: str) -> None:
        windows[label] = max(windows.get(label, 0), tracker.peak_bytes)
        tracker.reset_peak()

    with tracker:
        model = gpt_task.GPT(cfg)
        blocks = list(model.blocks)
        apply_checkpointing(blocks, args.checkpointing)
        model, _ = wrap_model(model, blocks=blocks, plan=plan, precision="bf16", device=torch.device("cpu"))
        for i, block in enumerate(blocks):
            block.register_full_backward_hook(lambda *_a, i=i: close(f"backward block {i}"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=args.foreach)
        for step in range(args.steps):
            windows.clear()
            x, y = gpt_task.make_batch(cfg, args.micro_batch, step, rank)
            tracker.reset_peak()
            logits = model(x)
            logits.register_hook(lambda g: close("loss backward (to the logits)"))
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, cfg.vocab), y.reshape(-1))
            del logits
            close("forward + loss")
            loss.backward()
            close("rest of backward")
            before = tracker.current_bytes
            optimizer.step()
            close("optimizer step")
            optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"FSDP2 stage {args.stage} ckpt {args.checkpointing} offload {args.offload} foreach {args.foreach}: "
              f"live before step {before / MIB:.3f} MiB ({before} B)")
        for label, peak in windows.items():
            print(f"  {label:32s} {peak / MIB:9.3f} MiB  {peak:>11d} B")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
