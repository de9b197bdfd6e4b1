"""The estimator against one real GPU: a ~1B Llama (random weights) under DeepSpeed ZeRO 0–3, CPU
offload and FSDP2, world size 1, a few steps each.

    PYTHONPATH=. python benchmarks/gpu_check.py            # on a GPU, < 8 minutes
    PYTHONPATH=. python benchmarks/gpu_check.py --cpu      # tiny Llama on CPU (gloo), seconds

Per plan: ``torch.cuda.max_memory_allocated`` beside the estimate's ``peak_allocated``,
``max_memory_reserved`` beside the estimate's ``peak_reserved`` (allocated + the caching
allocator's reserve, zeroplan.estimator.allocator; the CUDA context is in neither), the
estimate's total (+ CUDA context) beside them, and the measured step time beside the predicted one. Writes one table to
benchmarks/results/gpu_check.txt (``--cpu``: gpu_check_cpu.txt; live tensor storage, no reserve)
and the rows as JSON beside it. The GPU profile is the one NVML finds (``profiles.default_gpu``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

#: name → (backend/engine, plan fields)
PLANS = {
    "ds-z0": ("deepspeed", dict(stage=0)),
    "ds-z1": ("deepspeed", dict(stage=1)),
    "ds-z2": ("deepspeed", dict(stage=2)),
    "ds-z3": ("deepspeed", dict(stage=3)),
    "ds-z2+offload": ("deepspeed", dict(stage=2, offload_optimizer="cpu")),
    "ds-z3+offload": ("deepspeed", dict(stage=3, offload_optimizer="cpu", offload_param="cpu")),
    "fsdp2-s3": ("fsdp", dict(stage=3)),
}
#: TinyLlama-1.1B's shape (h 2048, 22 layers in the original; 16 here keep it ~0.9B and fast).
GPU_MODEL = ("--hidden", "2048", "--layers", "16", "--heads", "32", "--kv-heads", "4", "--ffn", "5632", "--vocab", "32000", "--seq-len", "1024")
CPU_MODEL = ("--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--ffn", "176", "--vocab", "512", "--seq-len", "64")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="tiny model on CPU ranks (what the tests run)")
    p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of {', '.join(PLANS)}")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per plan")
    p.add_argument("-o", "--output", type=Path, help="table path [default: benchmarks/results/gpu_check(_cpu).txt]")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.plans.split(",") if n.strip()]
    unknown = [n for n in names if n not in PLANS]
    if unknown:
        p.error(f"unknown plans {unknown}; choose from {', '.join(PLANS)}")
    if args.cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

    from rich.console import Console
    from rich.table import Table

    import gpu_check_task
    from zeroplan import profiles
    from zeroplan.estimator import estimate_plan
    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.spec import ClusterSpec, Plan, TrainingSpec

    script_args = CPU_MODEL if args.cpu else GPU_MODEL
    task_args = gpu_check_task.parse(list(script_args))
    model = gpu_check_task.model_spec(task_args)
    training = TrainingSpec(precision="bf16", seq_len=task_args.seq_len, loss="hf")
    gpu, gpu_note = profiles.default_gpu()
    cluster = ClusterSpec(gpus=1, gpus_per_node=1, gpu=gpu)
    rows = []
    started = time.monotonic()
    for name in names:
        engine, fields = PLANS[name]
        plan = Plan(micro_batch=args.micro_batch, **fields)
        with tempfile.TemporaryDirectory(prefix="zeroplan-gpucheck-") as tmp:
            reserved_file = Path(tmp) / "reserved.json"
            result = run_probe(ProbeRequest(
                script=ROOT / "benchmarks" / "gpu_check_task.py", nproc=1, backend=engine, plan=plan, training=training,
                script_args=script_args, steps=args.steps, warmup=2, timeout_s=args.timeout,
                env=(("ZEROPLAN_RESERVED_FILE", str(reserved_file)),),
            ))
            reserved = json.loads(reserved_file.read_text())["max_memory_reserved"] if reserved_file.exists() else None
        on_cpu = result.memory_kind != "cuda"
        est = estimate_plan(model, cluster, training, plan, device="cpu" if on_cpu else "cuda", engine=engine)
        rows.append({
            "plan": name, "engine": engine, "status": result.status, "error": result.error,
            "measured_allocated": result.peak_memory, "estimated_allocated": result.estimated_peak_memory,
            "measured_reserved": reserved, "estimated_reserved": int(est.gpu.peak_reserved), "estimated_total": int(est.gpu.total),
            "measured_step_s": result.step_time, "predicted_step_s": est.step_time, "memory_kind": result.memory_kind,
        })
    elapsed = time.monotonic() - started

    def err(est, meas):
        return f"{(est - meas) / meas:+.1%}" if est and meas else "—"

    unit, scale = ("KiB", 2**10) if args.cpu else ("MiB", 2**20)

    def mib(n):
        return f"{n / scale:,.0f}" if n else "—"

    kind = "CPU (gloo, live tensor storage)" if args.cpu else f"{gpu.name} ({gpu_note})"
    table = Table(title=f"{model.name} ({model.params / 1e9:.3g}B params, random weights), seq {training.seq_len}, "
                        f"micro-batch {args.micro_batch}, bf16, world size 1 on {kind}; {unit}", title_justify="left")
    for col in ("plan", "status", "alloc meas", "alloc est", "err", "reserved meas", "reserved est", "err", "total est", "step s meas", "step s pred"):
        table.add_column(col, justify="left" if col in ("plan", "status") else "right")
    for r in rows:
        table.add_row(
            r["plan"], r["status"] if r["status"] == "ok" else f"{r['status']}: {(r['error'] or '')[:30]}",
            mib(r["measured_allocated"]), mib(r["estimated_allocated"]), err(r["estimated_allocated"], r["measured_allocated"]),
            mib(r["measured_reserved"]), mib(r["estimated_reserved"]), err(r["estimated_reserved"], r["measured_reserved"]),
            mib(r["estimated_total"]),
            f"{r['measured_step_s']:.3f}" if r["measured_step_s"] else "—", f"{r['predicted_step_s']:.3f}",
        )
    out_path = args.output or ROOT / "benchmarks" / "results" / ("gpu_check_cpu.txt" if args.cpu else "gpu_check.txt")
    with out_path.open("w") as fh:
        console = Console(file=fh, width=170)
        console.print(table)
        console.print(f"{len(rows)} plans in {elapsed:.0f} s; estimate: zeroplan.estimator.estimate_plan (engine per row, --loss hf)")
    out_path.with_suffix(".json").write_text(json.dumps({"model": model.as_dict(), "rows": rows, "elapsed_s": elapsed}, indent=2) + "\n")
    Console(width=170).print(table)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
