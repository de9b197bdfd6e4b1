"""DeepSpeed's collective calls per optimizer step, counted on a real engine, against the estimator's count.

Run under torchrun (one stage per run); rank 0 prints one JSON line. bench_engine_work.py runs
every stage and prints the table. Every ``torch.distributed`` collective DeepSpeed issues is
counted by wrapping the functions before DeepSpeed binds them; the engine is the example GPT
(examples/gpt_task.py) with the DeepSpeed config ``zeroplan export`` writes for the plan.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/engine_collectives.py --stage 1 --micro-batch 2 --accumulation 2
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.distributed as tdist  # noqa: E402

COLLECTIVES = ("all_reduce", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_gather", "reduce_scatter", "all_to_all_single")
counts: collections.Counter = collections.Counter()


def _wrap(name: str) -> None:
    original = getattr(tdist, name)

    def counted(*args, **kwargs):
        counts[name] += 1
        return original(*args, **kwargs)

    setattr(tdist, name, counted)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-overlap-comm", action="store_true", help="zero_optimization.overlap_comm false (stages 1-2)")
    p.add_argument("--max-reuse-distance", type=int, default=None, help="stage3_max_reuse_distance (default: DeepSpeed's 1e9)")
    args = p.parse_args()
    for name in COLLECTIVES:
        if hasattr(tdist, name):
            _wrap(name)
    import deepspeed

    from gpt_task import GPT, GPTConfig

    from zeroplan.dsconfig import build_config
    from zeroplan.estimator.engine_work import engine_work, stage3_gathers
    from zeroplan.runtime.rank.dsops import skip_shm_comm_op
    from zeroplan.spec import Plan, TrainingSpec
    from zeroplan.tuner.checks import task_declaration

    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    declared = task_declaration(ROOT / "examples" / "gpt_task.py")
    model_spec, seq_len = declared.model_spec, declared.seq_len
    plan = Plan(stage=args.stage, micro_batch=args.micro_batch, gradient_accumulation_steps=args.accumulation,
                stage3_max_reuse_distance=args.max_reuse_distance, overlap_comm=not args.no_overlap_comm)
    training = TrainingSpec(seq_len=seq_len, global_batch=args.micro_batch * args.accumulation * world)
    cfg = build_config(plan, world_size=world, training=training, model=model_spec)
    skip_shm_comm_op()
    deepspeed.init_distributed(dist_backend="gloo")
    gpt = GPT(GPTConfig())
    engine, *_ = deepspeed.initialize(model=gpt, config=cfg, model_parameters=gpt.parameters())
    data = torch.randint(0, GPTConfig().vocab, (args.micro_batch, seq_len + 1))

    split = collections.Counter()  # all-gather calls issued during forward and during backward

    def optimizer_step() -> None:
        for _ in range(args.accumulation):
            before = counts["all_gather_into_tensor"]
            logits = engine(data[:, :-1])
            split["forward"] += counts["all_gather_into_tensor"] - before
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
            before = counts["all_gather_into_tensor"]
            engine.backward(loss)
            split["backward"] += counts["all_gather_into_tensor"] - before
            engine.step()

    for _ in range(2):
        optimizer_step()
    counts.clear()
    split.clear()
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        optimizer_step()
    elapsed = (time.perf_counter() - start) / args.steps
    # This rank's CPU seconds per step (all its threads): the work done, less the waits a loaded machine adds.
    cpu = (time.process_time() - cpu_start) / args.steps
    if tdist.get_rank() == 0:
        measured = {k: v / args.steps for k, v in counts.items()}
        predicted = engine_work(model_spec, plan, world_size=world, precision=training.precision)
        replayed = None
        zero = cfg.get("zero_optimization", {})
        if args.stage == 3:
            # The coordinator's replay on the real module tree (a tied weight keeps one name), not the
            # estimator's assumed shapes: all-gathers per micro-step, to set beside the measured count.
            threshold = zero["stage3_param_persistence_threshold"]

            def own(m):
                return tuple((f"p{id(t)}", t.ds_numel) for t in m.parameters(recurse=False) if t.ds_numel > threshold)

            # Hook order: the model, then its modules in forward order; backward in reverse, each
            # block before its children.
            leaves = [gpt.tok, gpt.pos] + [x for b in gpt.blocks for x in (b, b.ln1, b.qkv, b.proj, b.ln2, b.fc, b.out)] + [gpt.ln_f, gpt.head]
            back = [gpt.head, gpt.ln_f] + [x for b in reversed(gpt.blocks) for x in (b, b.out, b.fc, b.ln2, b.proj, b.qkv, b.ln1)] + [gpt.pos, gpt.tok]
            gathers = stage3_gathers(tuple(own(m) for m in [gpt] + leaves), tuple(own(m) for m in [gpt] + back),
                                     prefetch_bucket=zero["stage3_prefetch_bucket_size"],
                                     max_reuse_distance=zero.get("stage3_max_reuse_distance", 1_000_000_000))
            replayed = {"forward_calls": gathers.forward_calls, "backward_calls": gathers.backward_calls,
                        "per_step": args.accumulation * (gathers.forward_calls + gathers.backward_calls)}
        print(json.dumps({"stage": args.stage, "micro_batch": args.micro_batch, "accumulation": args.accumulation,
                          "measured": measured, "measured_total": sum(measured.values()), "predicted": predicted.collectives, "replayed_gathers": replayed,
                          "measured_gathers": {k: v / args.steps for k, v in split.items()},
                          "step_s": elapsed, "step_cpu_s": cpu, "overlap_comm": not args.no_overlap_comm, "params": sum(1 for _ in gpt.parameters()), "zero": cfg.get("zero_optimization")}))


if __name__ == "__main__":
    main()
