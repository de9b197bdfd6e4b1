"""Bytes DeepSpeed's optimizer step allocates beyond the live state, by optimizer implementation
(example GPT task, CPU ranks, live tensor storage), beside the estimator's step buffers.

    PYTHONPATH=. python -m torch.distributed.run --nproc_per_node 2 \
        benchmarks/optimizer_step_memory.py --stage 2 --impl torch-loop      # one run, one JSON line
    PYTHONPATH=. python benchmarks/optimizer_step_memory.py --table -o benchmarks/results/optimizer_step_memory.txt

``--impl``: ``config`` (an ``optimizer`` block: DeepSpeed builds FusedAdam), ``cpu-adam`` (the
same block with ``offload_optimizer: cpu``: DeepSpeedCPUAdam), ``torch-loop`` / ``torch-foreach``
/ ``torch-fused`` (a client ``torch.optim.AdamW(foreach=False | True | fused=True)`` passed to
``deepspeed.initialize``, as Hugging Face's Trainer does when the config has no ``optimizer``
block; the for-loop is torch's CPU default, foreach its CUDA default). One run prints one JSON
line on rank 0: live bytes before the last ``engine.step()`` and the largest increase inside it.
``--table`` runs every stage × implementation on 2 ranks and prints measured beside predicted
(``engine_overhead(...).during_step``, the estimator's step buffers for that implementation, and
the step's peak); ``--from-json`` re-renders a previous run's measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

IMPLS = ("config", "cpu-adam", "torch-loop", "torch-foreach", "torch-fused")
#: --impl → zeroplan's --optimizer-impl (torch-loop is AdamW(foreach=False): torch-forloop, the
#: same temporaries on a GPU as on CPU).
ESTIMATOR_IMPL = {"config": "deepspeed-fused", "cpu-adam": "deepspeed-cpu", "torch-loop": "torch-forloop",
                  "torch-foreach": "torch", "torch-fused": "torch-fused"}
SIZES = dict(layers=4, hidden=256, heads=4, vocab=8192, seq_len=128)
MICRO_BATCH = 2


def run_one(stage: int, impl: str, steps: int) -> dict:
    import deepspeed
    import torch
    import torch.distributed as dist

    import gpt_task
    from zeroplan.runtime.rank.dsops import skip_shm_comm_op
    from zeroplan.runtime.measure.memory import StorageTracker

    skip_shm_comm_op()

    cfg = gpt_task.GPTConfig(**SIZES)
    zero: dict = {"stage": stage, "reduce_bucket_size": cfg.hidden**2}
    if impl == "cpu-adam":
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
    }
    if impl in ("config", "cpu-adam"):
        config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    tracker = StorageTracker()
    with tracker:
        model = gpt_task.GPT(cfg)
        client = {}
        if impl.startswith("torch-"):
            kind = {"torch-loop": dict(foreach=False), "torch-foreach": dict(foreach=True), "torch-fused": dict(fused=True)}[impl]
            client["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3, **kind)
        engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config, **client)
        rank = dist.get_rank()
        for step in range(steps):
            engine.backward(gpt_task.lm_loss(engine, gpt_task.make_batch(cfg, MICRO_BATCH, step, rank)))
            before = tracker.current_bytes
            tracker.reset_peak()
            engine.step()
            step_extra = tracker.peak_bytes - before
    inner = type(getattr(optimizer, "optimizer", optimizer)).__name__
    return {"stage": stage, "impl": impl, "optimizer": inner, "world_size": dist.get_world_size(),
            "before_step_bytes": before, "step_extra_bytes": step_extra, "rank": rank}


def predicted(stage: int, impl: str, nproc: int) -> tuple[dict[str, int], int]:
    """The estimator's step buffers (``during_step``) for the same run on CPU, and its step peak:
    model states + ``always`` + ``during_step`` (what the rank holds at the step's peak)."""
    import gpt_task
    from zeroplan.estimator.memory import engine_overhead, host_memory, model_states
    from zeroplan.profiles import default_gpu
    from zeroplan.spec import ClusterSpec, Plan, TrainingSpec

    cfg = gpt_task.GPTConfig(**SIZES)
    model = gpt_task.model_spec(cfg)
    cluster = ClusterSpec(gpus=nproc, gpus_per_node=nproc, gpu=default_gpu()[0])
    plan = Plan(stage=stage, micro_batch=MICRO_BATCH, offload_optimizer="cpu" if impl == "cpu-adam" else "none",
                reduce_bucket_size=cfg.hidden**2)
    training = TrainingSpec(seq_len=cfg.seq_len, loss="plain")
    # On CPU torch's AdamW runs its for-loop unless told foreach=True: the foreach temporaries are
    # the CUDA default's (on_gpu=True in optimizer_step_temporaries).
    device = "cuda" if impl == "torch-foreach" else "cpu"
    extra = engine_overhead(model, cluster, training, plan, device=device, optimizer_impl=ESTIMATOR_IMPL[impl])
    states = model_states(model, cluster, training, plan)
    # Offloaded states and DeepSpeed's host buffers live in this rank's host memory, which is what
    # the CPU tracker counts: the node's host items over its ranks (as the probe compares).
    offloaded = sum(host_memory(model, cluster, training, plan, states).cpu_items.values()) // nproc
    peak = states.total + offloaded + sum(extra.always.values()) + sum(extra.during_step.values())
    return dict(extra.during_step), peak


def measure_all(args) -> list[dict]:
    rows = []
    for stage in args.stages:
        for impl in args.impls:
            env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                                __file__, "--stage", str(stage), "--impl", impl, "--steps", str(args.steps)],
                               capture_output=True, text=True, env=env, timeout=args.timeout)
            line = next((ln for ln in r.stdout.splitlines() if ln.startswith("{")), None)
            if line is None:
                print(f"stage {stage} {impl}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
                continue
            rows.append(json.loads(line))
            print(f"stage {stage} {impl}: {rows[-1]['step_extra_bytes']:,} bytes in the step", file=sys.stderr)
    return rows


def render(rows: list[dict], args) -> str:
    cfg_line = (f"example GPT L{SIZES['layers']} h{SIZES['hidden']} V{SIZES['vocab']} s{SIZES['seq_len']}, micro-batch {MICRO_BATCH}, "
                f"bf16, {args.nproc} CPU ranks (DS_ACCELERATOR=cpu), reduce bucket h², last of {args.steps} steps, rank 0")
    lines = [f"Optimizer step temporaries under DeepSpeed: {cfg_line}",
             "step extra: bytes the step allocates above the live bytes before it; predicted: the estimator's step buffers",
             "(engine_overhead(...).during_step) and step peak (model states + always + during_step)", "",
             f"{'stage':>5}  {'impl':<14} {'optimizer':<18} {'step extra':>12} {'predicted':>12} {'err':>7} {'peak':>12} "
             f"{'predicted':>12} {'err':>7}  items"]
    for row in rows:
        items, peak_pred = predicted(row["stage"], row["impl"], args.nproc)
        row["predicted_step_bytes"], row["predicted_items"], row["predicted_peak_bytes"] = sum(items.values()), items, peak_pred
        meas, pred = row["step_extra_bytes"], row["predicted_step_bytes"]
        peak = row["before_step_bytes"] + meas
        err = f"{(pred - meas) / meas:+.1%}" if meas > 1024 else "—"
        text = ", ".join(f"{k} {v:,}" for k, v in items.items()) or "none"
        lines.append(f"{row['stage']:>5}  {row['impl']:<14} {row['optimizer']:<18} {meas:>12,} {pred:>12,} {err:>7} {peak:>12,} "
                     f"{peak_pred:>12,} {(peak_pred - peak) / peak:>+7.1%}  {text}")
    return "\n".join(lines) + "\n"


def table(args) -> int:
    rows = json.loads(args.from_json.read_text())["rows"] if args.from_json else measure_all(args)
    text = render(rows, args)
    if args.output:
        args.output.write_text(text)
        args.output.with_suffix(".json").write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(text)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2, choices=(0, 1, 2, 3))
    p.add_argument("--impl", default="config", choices=IMPLS)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--runs", type=lambda s: [(int(x.split(":")[0]), x.split(":")[1]) for x in s.split(",")],
                   help="STAGE:IMPL,... measured one after another in the same ranks (one launch; one JSON line each)")
    p.add_argument("--table", action="store_true", help="run every --stages × --impls combination and print the table")
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    p.add_argument("--impls", type=lambda s: s.split(","), default=list(IMPLS))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--from-json", type=Path, help="render the table from a previous run's JSON instead of measuring")
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args()
    if args.table or args.from_json:
        return table(args)
    for stage, impl in args.runs or [(args.stage, args.impl)]:
        row = run_one(stage, impl, args.steps)
        if row.pop("rank") == 0:
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
