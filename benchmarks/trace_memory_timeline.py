"""Timeline of live tensor bytes through DeepSpeed training steps on CPU ranks (example GPT task).

    PYTHONPATH=. DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 \
        benchmarks/trace_memory_timeline.py --stage 2 [--offload cpu] [--gas 2] [--steps 3]

Wraps the whole run in zeroplan.runtime.measure.memory.StorageTracker (the probes' CPU meter) and prints,
on rank 0, the live MiB (and bytes) at labelled points of each micro-step (forward, the gradient
reaching the fp32 and the 16-bit logits, each block's backward, DeepSpeed's first gradient hook,
first bucket flush and backward epilogue, before and after the optimizer step), the largest live
MiB seen under each label, and the optimizer's tensor attributes (MiB) before the step.
``--reduce-bucket-size`` and ``--no-overlap-comm`` change the reduce buffers. The loss function
is the task's (logits die when it returns), so the peaks match ``benchmarks/bench_probe_memory.py``. Findings: docs/notes/memory-gaps.md.
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

    from zeroplan.runtime.measure.memory import storages_of

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


def _live_tensor_census(min_mib: float = 0.2) -> list[str]:
    """Live tensors the garbage collector can see, one line per storage of at least ``min_mib``:
    size, dtype, shape and whether it is some parameter's ``.grad`` (tensors held only inside
    autograd's C++ buffers are not reachable and do not appear)."""
    import gc

    import torch

    seen: dict[int, str] = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
                continue
            st = obj.untyped_storage()
        except Exception:  # noqa: BLE001 - objects that refuse inspection
            continue
        key = st.data_ptr()
        if key in seen or st.nbytes() < min_mib * MIB:
            continue
        kind = "param" if isinstance(obj, torch.nn.Parameter) else "tensor"
        seen[key] = f"{st.nbytes() / MIB:8.2f}  {kind} {str(obj.dtype).removeprefix('torch.')} {tuple(obj.shape)}"
    return sorted(seen.values(), reverse=True)


def _wrap_engine_moments(engine, mark) -> None:
    """Mark the moments DeepSpeed allocates or frees its gradient buffers.

    Stages 1–2: ``setup_buckets`` (the ipg buffers, at the first gradient hook of a backward),
    the first write into ``grads_in_partition`` (the gradient partition, at the first bucket
    flush) and ``_release_ipg_buffers`` (the backward epilogue). Stage 0: the engine's
    ``allreduce_gradients`` (after backward). Stage 3: ``reduce_independent_p_g_buckets_and_remove_grads``
    at its first call per backward (the first gradient hook).
    """
    opt = engine.optimizer
    if hasattr(opt, "setup_buckets"):
        setup = opt.setup_buckets

        def setup_buckets():
            first = not opt.ready_for_gradients
            setup()
            if first:
                mark("first gradient hook: ipg buffers allocated", "bwd after first hook")

        opt.setup_buckets = setup_buckets
        copy = opt.copy_grads_in_partition

        def copy_grads_in_partition(*a, **k):
            first = opt.grads_in_partition is None
            copy(*a, **k)
            if first:
                mark("first flush: gradient partition allocated", "bwd after first flush")

        opt.copy_grads_in_partition = copy_grads_in_partition
        release = opt._release_ipg_buffers

        def release_ipg_buffers():
            mark("epilogue: before the ipg buffers are released", "bwd epilogue")
            release()
            mark("epilogue: ipg buffers released", "after backward")

        opt._release_ipg_buffers = release_ipg_buffers
    allreduce = engine.allreduce_gradients

    def allreduce_gradients(*a, **k):
        mark("allreduce_gradients start", "allreduce_gradients")
        out = allreduce(*a, **k)
        mark("allreduce_gradients end", "after backward")
        return out

    engine.allreduce_gradients = allreduce_gradients


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
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--peak-stack", action="store_true", help="print the Python stack that allocated each rank's peak")
    p.add_argument("--census", action="store_true", help="list the live tensors (gc) at the last step's token-embedding backward, every rank")
    p.add_argument("--big-mib", type=float, default=0.0, help="list every allocation of at least this many MiB (op, label, live MiB) on rank 0")
    p.add_argument("--reduce-bucket-size", type=int, default=None, help="elements (default: the model's h², Hugging Face's rule)")
    p.add_argument("--no-overlap-comm", action="store_true", help="overlap_comm false (zeroplan's configs set it true)")
    p.add_argument("--print-rank", type=int, default=0, help="the rank whose timeline is printed (the last one owns the last blocks' partition)")
    args = p.parse_args()

    import torch

    from zeroplan.runtime.measure.memory import StorageTracker

    import traceback

    label = ["init"]
    events: list[tuple[str, int]] = []
    max_by_label: dict[str, int] = {}
    peak_at: list = [0, "", [], 0, []]  # bytes, label, stack, bytes of the allocation that set it, largest live storages

    big: list[str] = []

    class Tracker(StorageTracker):
        op = "?"

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.op = str(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _add(self, st) -> None:
            before = self.current_bytes
            super()._add(st)
            if args.big_mib and self.current_bytes - before >= args.big_mib * MIB:
                frames = [f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-3]][-3:]
                big.append(f"{(self.current_bytes - before) / MIB:6.2f} MiB by {self.op} under '{label[0]}' -> live {self.current_bytes / MIB:.2f}; {' < '.join(reversed(frames))}")
            if self.current_bytes > max_by_label.get(label[0], 0):
                max_by_label[label[0]] = self.current_bytes
            if args.peak_stack and self.current_bytes > peak_at[0]:
                stack = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}: {f.line}" for f in traceback.extract_stack()[:-3]]
                largest = sorted(self._sizes.values(), reverse=True)[:8]
                peak_at[:] = [self.current_bytes, label[0], stack[-14:], self.current_bytes - before, largest]

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
        plan = Plan(micro_batch=args.micro_batch, stage=args.stage, offload_optimizer=args.offload, gradient_accumulation_steps=args.gas,
                    reduce_bucket_size=args.reduce_bucket_size)
        training = TrainingSpec(precision=args.precision, seq_len=args.seq_len)
        config = build_config(plan, world_size=dist.get_world_size(), training=training, model=gpt_task.model_spec(cfg))
        if args.no_overlap_comm and args.stage > 0:
            config["zero_optimization"]["overlap_comm"] = False
        model = gpt_task.GPT(cfg)
        mark("model built")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
        mark("after deepspeed.initialize")
        rank = dist.get_rank()
        step = 0
        _wrap_engine_moments(engine, lambda name, new_label=None: mark(f"s{step} {name}", new_label and f"s{step} {new_label}"))
        for i, block in enumerate(model.blocks):
            block.register_full_backward_pre_hook(lambda m, g, i=i: mark(f"s{step} bwd block{i} start", f"s{step} bwd block{i}"))
        # The token embedding's backward comes last; with tied weights its gradient and the head's
        # meet there (one AccumulateGrad node for the shared leaf).
        at_embedding = []
        census: list[str] = []

        def embedding_start(m, g):
            mark(f"s{step} bwd token embedding start", f"s{step} bwd embedding")
            at_embedding.append((step, _optimizer_tensor_mib(engine.optimizer)))
            if args.census and step == args.steps - 1:
                census.extend(_live_tensor_census())

        model.tok.register_full_backward_pre_hook(embedding_start)
        model.tok.weight.register_hook(lambda g: mark(f"s{step} summed gradient reaches tok.weight ({g.numel() * g.element_size() / MIB:.2f} MiB)",
                                                      f"s{step} bwd tok.weight grad"))

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

        if rank == args.print_rank:
            inner = getattr(engine.optimizer, "optimizer", None)
            print(f"stage {args.stage}, offload_optimizer {args.offload}, gas {args.gas}, {args.precision}: {type(engine.optimizer).__name__}"
                  f" over {type(inner).__name__}; MiB of live tensor storage on rank {rank}")
            print("timeline:")
            for name, live in events:
                print(f"  {live / MIB:9.2f}  {live:>12,} B  {name}")
            print("largest live MiB under each label:")
            for name, live in max_by_label.items():
                print(f"  {live / MIB:9.2f}  {live:>12,} B  {name}")
            print(f"peak: {tracker.peak_bytes / MIB:.2f} MiB")
            if args.big_mib:
                print(f"allocations of at least {args.big_mib:g} MiB:")
                for line in big:
                    print(f"  {line}")
            for step_no, tensors in before_step:
                print(f"optimizer tensors before step s{step_no} (MiB): {tensors}")
            for step_no, tensors in at_embedding:
                print(f"optimizer tensors at the token embedding's backward s{step_no} (MiB): {tensors}")
        if args.census:
            for r in range(dist.get_world_size()):
                if r == rank:
                    print(f"rank {rank}: live tensors reachable from Python at the token embedding's backward (MiB, storage counted once):")
                    for line in census:
                        print(f"    {line}")
                    sys.stdout.flush()
                dist.barrier()
        if args.peak_stack:
            for r in range(dist.get_world_size()):
                if r == rank:
                    print(f"rank {rank} peak {peak_at[0] / MIB:.2f} MiB under '{peak_at[1]}', set by a {peak_at[3] / MIB:.2f} MiB allocation; "
                          f"largest live storages then (MiB): {[round(b / MIB, 2) for b in peak_at[4]]}; allocated at:")
                    for line in peak_at[2]:
                        print(f"    {line}")
                    sys.stdout.flush()
                dist.barrier()
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip engine teardown (gloo threads), as zeroplan.runtime.rank.worker does


if __name__ == "__main__":
    sys.exit(main())
