"""Accuracy of the memory estimator against measured probes: the example GPT under DeepSpeed
ZeRO stages 0–3 and optimizer/parameter offload, 2 processes.

    PYTHONPATH=. python benchmarks/bench_probe_memory.py                # CPU: live tensor storage
    PYTHONPATH=. python benchmarks/bench_probe_memory.py --format json -o bench.json

Per plan and rank it prints:

* model states: the ZeRO paper's 2Ψ+2Ψ+12Ψ split for the plan (estimator ``states``), and the
  estimator's states + engine buffers of the backward phase (on CPU runs plus the host share of
  offloaded states) beside the live bytes measured just before the optimizer step (after the
  last backward: activations freed, gradients still there);
* peak: the estimator's comparable peak (``max_memory_allocated`` on CUDA, live tensor storage on
  CPU) beside the measured peak, with the relative error (estimated − measured) / measured.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PLANS = {
    "z0": dict(stage=0),
    "z1": dict(stage=1),
    "z2": dict(stage=2),
    "z3": dict(stage=3),
    "z2+opt:cpu": dict(stage=2, offload_optimizer="cpu"),
    "z3+opt:cpu": dict(stage=3, offload_optimizer="cpu"),
    "z3+opt+param:cpu": dict(stage=3, offload_optimizer="cpu", offload_param="cpu"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of {', '.join(PLANS)}")
    p.add_argument("--reduce-bucket-size", type=int, default=None,
                   help="elements per reduce bucket (default: Hugging Face's h², as zeroplan's configs)")
    p.add_argument("--no-overlap-comm", action="store_true", help="overlap_comm false (one reduce buffer in stages 1–2)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--format", default="table", choices=("table", "json"))
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from zeroplan import estimator, profiles
    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.estimator.memory import engine_overhead
    from zeroplan.runtime.probe import comparable_estimate
    from zeroplan.spec import ClusterSpec, Plan, TrainingSpec

    names = [n.strip() for n in args.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        p.error(f"unknown plans {unknown}; choose from {', '.join(PLANS)}")
    from zeroplan.runtime.rank.task import load_task

    script_args = ("--layers", str(args.layers), "--hidden", str(args.hidden), "--heads", str(args.heads),
                   "--vocab", str(args.vocab), "--seq-len", str(args.seq_len))
    # The task's own model spec (no dropout) and loss (its loop drops the logits: plain), as the
    # probe's own estimate uses them.
    task = load_task(ROOT / "examples" / "gpt_task.py", script_args)
    model = task.model_spec
    training = TrainingSpec(precision=args.precision, seq_len=args.seq_len, loss=task.loss or "hf")
    gpu, _ = profiles.default_gpu()
    cluster = ClusterSpec(gpus=args.nproc, gpus_per_node=args.nproc, gpu=gpu)

    rows = []
    console = Console(stderr=True)
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task("probing", total=len(names))
        for name in names:
            progress.update(bar, description=f"probing {name}")
            plan = Plan(micro_batch=args.micro_batch, reduce_bucket_size=args.reduce_bucket_size,
                        overlap_comm=not args.no_overlap_comm, **PLANS[name])
            result = run_probe(ProbeRequest(script=ROOT / "examples" / "gpt_task.py", nproc=args.nproc, plan=plan, training=training,
                                            script_args=script_args, steps=args.steps, warmup=args.warmup, timeout_s=args.timeout))
            on_cpu = result.memory_kind != "cuda"
            est = estimator.estimate_plan(model, cluster, training, plan, device="cpu" if on_cpu else "cuda")
            host_share = sum(est.host.cpu_items.values()) // args.nproc if on_cpu else 0
            # Before the step the backward's buffers are freed (the reduce buffers of stages 1–2
            # at the epilogue); stage 3's gathered parameters are counted as before.
            extra = engine_overhead(model, cluster, training, plan, device="cpu" if on_cpu else "cuda")
            always = sum(extra.always.values()) + sum(extra.during_backward.values())
            rows.append({
                "plan": name,
                "status": result.status,
                "error": result.error,
                "params": model.params,
                "estimated_model_states": est.states.total,
                "estimated_state_memory": est.states.total + always + host_share,
                "measured_state_memory_per_rank": result.state_memory_per_rank,
                "estimated_peak": comparable_estimate(est, on_cpu=on_cpu, ranks_per_node=args.nproc),
                "probe_estimated_peak": result.estimated_peak_memory,
                "measured_peak_per_rank": result.peak_memory_per_rank,
                "estimated_activations": est.gpu.activations,
                "overhead_items": est.overhead_items,
                "peak_phase": est.peak_phase,
                "peak_note": next((n for n in est.notes if n.startswith("peak")), ""),
                "reduce_bucket_size": args.reduce_bucket_size,
                "overlap_comm": not args.no_overlap_comm,
                "step_time_s": result.step_time,
                "memory_kind": result.memory_kind,
                "workdir": result.workdir,
            })
            progress.advance(bar)

    if args.format == "json":
        text = json.dumps({"model": model.as_dict(), "training": training.as_dict(), "nproc": args.nproc, "plans": rows}, indent=2)
        if args.output:
            args.output.write_text(text + "\n")
        else:
            print(text)
        return 0 if all(r["status"] == "ok" for r in rows) else 1

    out = Console(file=args.output.open("w") if args.output else None, width=160)
    bucket = f"reduce bucket {args.reduce_bucket_size:,}" if args.reduce_bucket_size else f"reduce bucket h² = {args.hidden ** 2:,}"
    title = (f"DeepSpeed on {args.nproc} ranks: GPT L{args.layers} h{args.hidden} V{args.vocab} s{args.seq_len} "
             f"(Ψ = {model.params:,}), micro-batch {args.micro_batch}, {args.precision}, {bucket}, "
             f"overlap_comm {'false' if args.no_overlap_comm else 'true'}; MiB per rank")
    table = Table(title=title, title_justify="left")
    for col in ("plan", "rank", "states (paper)", "states+bufs est", "before step meas", "err", "peak est", "peak meas", "err", "step s"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    mib = lambda n: f"{n / 2**20:,.2f}"  # noqa: E731
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["plan"], "—", mib(r["estimated_model_states"]), "", "", "", "", "", r["status"], (r["error"] or "")[:40])
            continue
        for rank, (res, peak) in enumerate(zip(r["measured_state_memory_per_rank"] or [0] * len(r["measured_peak_per_rank"]), r["measured_peak_per_rank"])):
            table.add_row(
                r["plan"] if rank == 0 else "",
                str(rank),
                mib(r["estimated_model_states"]),
                mib(r["estimated_state_memory"]),
                mib(res),
                f"{(r['estimated_state_memory'] - res) / res:+.1%}" if res else "—",
                mib(r["estimated_peak"]),
                mib(peak),
                f"{(r['estimated_peak'] - peak) / peak:+.1%}",
                f"{r['step_time_s']:.3f}" if rank == 0 and r["step_time_s"] else "",
            )
    out.print(table)
    kind = rows[0]["memory_kind"] if rows else None
    if kind == "cpu-storage":
        out.print("measured: live tensor storage per rank (CPU run, DS_ACCELERATOR=cpu); offloaded states are host memory "
                  "here, so their per-rank share is in the estimates too")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
