"""Timeline of live tensor bytes through DeepSpeed training steps on CPU ranks (example GPT task).

    PYTHONPATH=. DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 \
        benchmarks/trace_memory_timeline.py --stage 2 [--offload cpu] [--gas 2] [--steps 3]

Wraps the whole run in zeroplan.runtime.memory.StorageTracker (the probes' CPU meter) and prints,
on rank 0, the live MiB at labelled points of each micro-step (forward, the gradient reaching
the fp32 and the 16-bit logits, each block's backward, before and after the optimizer step), the
largest live MiB seen under each label, and the optimizer's tensor attributes (MiB) before the
step. The loss function is the task's (logits die when it returns), so the peaks match
``benchmarks/bench_probe_memory.py``. Findings: docs/notes/memory-gaps.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

MIB = 2**20


def _optimizer_tensor_mib(optimizer) -> dict[str, float]:
    """MiB of tensor storage held by each attribute of ``optimizer`` (tensors, lists, dicts; one level deep)."""
    import torch

    from zeroplan.runtime.memory import storages_of

    def leaves(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            for item in value:
                yield from leaves(item) if isinstance(item, (torch.Tensor, list, tuple, dict)) else ()
        elif isinstance(value, dict):
            for item in value.values():
                yield from leaves(item) if isinstance(item, (torch.Tensor, list, tuple, dict)) else ()

    seen: set[int] = set()
    out = {}
    for name, value in list(vars(optimizer).items()):
        total = 0
        for tensor in leaves(value):
            for st in storages_of(tensor):
                if id(st) not in seen:
                    seen.add(id(st))
                    total += st.nbytes()
        if total >= 0.05 * MIB:
            out[name] = round(total / MIB, 3)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--offload", default="none", choices=("none", "cpu"), help="offload_optimizer device")
    p.add_argument("--gas", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--steps", type=int, default=3, help="micro-steps (engine.backward + engine.step calls)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    args = p.parse_args()

    import torch

    from zeroplan.runtime.memory import StorageTracker

    label = ["init"]
    events: list[tuple[str, int]] = []
    max_by_label: dict[str, int] = {}

    class Tracker(StorageTracker):
        def _add(self, st) -> None:
            super()._add(st)
            if self.current_bytes > max_by_label.get(label[0], 0):
                max_by_label[label[0]] = self.current_bytes

    tracker = Tracker()

    def mark(name: str, new_label: str | None = None) -> None:
        if new_label is not None:
            label[0] = new_label
        events.append((name, tracker.current_bytes))

    with tracker:
        import deepspeed
        import torch.distributed as dist

        import gpt_task
        from zeroplan.dsconfig import build_config
        from zeroplan.spec import Plan, TrainingSpec

        deepspeed.init_distributed(dist_backend="gloo")
        cfg = gpt_task.GPTConfig(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab, seq_len=args.seq_len)
        plan = Plan(micro_batch=args.micro_batch, stage=args.stage, offload_optimizer=args.offload, gradient_accumulation_steps=args.gas)
        training = TrainingSpec(precision="bf16", seq_len=args.seq_len)
        config = build_config(plan, world_size=dist.get_world_size(), training=training, model=gpt_task.model_spec(cfg))
        model = gpt_task.GPT(cfg)
        mark("model built")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        mark("after deepspeed.initialize")
        rank = dist.get_rank()
        step = 0
        for i, block in enumerate(model.blocks):
            block.register_full_backward_pre_hook(lambda m, g, i=i: mark(f"s{step} bwd block{i} start", f"s{step} bwd block{i}"))

        def loss_fn(x, y):
            logits = engine(x)
            mark(f"s{step} after model forward (16-bit logits live)")
            fp32 = logits.float()
            loss = torch.nn.functional.cross_entropy(fp32.reshape(-1, fp32.shape[-1]), y.reshape(-1))
            fp32.register_hook(lambda g: mark(f"s{step} gradient reaches fp32 logits", f"s{step} bwd after loss"))
            logits.register_hook(lambda g: mark(f"s{step} gradient reaches 16-bit logits", f"s{step} bwd head"))
            return loss

        before_step = []
        for step in range(args.steps):
            mark(f"s{step} start", f"s{step} fwd")
            x, y = gpt_task.make_batch(cfg, args.micro_batch, step, rank)
            loss = loss_fn(x, y)
            mark(f"s{step} after loss forward (logits freed)", f"s{step} bwd loss")
            engine.backward(loss)
            del loss
            boundary = engine.is_gradient_accumulation_boundary()
            mark(f"s{step} after backward" + (" (before optimizer step)" if boundary else " (no step: accumulating)"))
            if boundary:
                before_step.append((step, _optimizer_tensor_mib(engine.optimizer)))
            label[0] = f"s{step} step"
            engine.step()
            mark(f"s{step} after engine.step()")

        if rank == 0:
            inner = getattr(engine.optimizer, "optimizer", None)
            print(f"stage {args.stage}, offload_optimizer {args.offload}, gas {args.gas}: {type(engine.optimizer).__name__}"
                  f" over {type(inner).__name__}; MiB of live tensor storage on rank 0")
            print("timeline:")
            for name, live in events:
                print(f"  {live / MIB:9.2f}  {name}")
            print("largest live MiB under each label:")
            for name, live in max_by_label.items():
                print(f"  {live / MIB:9.2f}  {name}")
            print(f"peak: {tracker.peak_bytes / MIB:.2f} MiB")
            for step_no, tensors in before_step:
                print(f"optimizer tensors before step s{step_no} (MiB): {tensors}")
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip engine teardown (gloo threads), as zeroplan.runtime.worker does


if __name__ == "__main__":
    sys.exit(main())
