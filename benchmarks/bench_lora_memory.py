"""LoRA memory: measured peak vs estimate, and the saving over full fine-tuning, on DeepSpeed or FSDP2.

    PYTHONPATH=. DS_ACCELERATOR=cpu python benchmarks/bench_lora_memory.py -o benchmarks/results/lora_memory.txt

examples/lora_task.py (a small Llama with random weights, peft LoRA) on 2 processes, ZeRO stages
0–3, LoRA ranks 8 and 64 on two target sets, and the same model fully fine-tuned; with
``--base-quant nf4`` the LoRA rows are QLoRA (the base reloaded in NF4 by bitsandbytes). Per row:
the estimator's comparable peak (live tensor storage on CPU, ``max_memory_allocated`` on CUDA)
beside the measured peak per rank, and the saving over full fine-tuning, predicted and measured:
1 − peak(LoRA) / peak(full).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _task_module():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import lora_task
    finally:
        sys.path.pop(0)
    return lora_task


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--ranks", default="8,64")
    p.add_argument("--targets", default="q_proj,v_proj;all-linear", help="target sets separated by ;")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--base-quant", default="none", choices=("none", "nf4"),
                   help="nf4: QLoRA rows (the LoRA configs on an NF4 base; the full fine-tune row stays bf16)")
    p.add_argument("--backend", default="deepspeed", choices=("deepspeed", "fsdp"),
                   help="fsdp: PyTorch's engines (stage 0 DDP, 1 ZeroRedundancyOptimizer, 2-3 FSDP2)")
    p.add_argument("--steps", type=int, default=2)
    # On CPU the probe's tracker measures the warm-up steps only (PeakMemory.stop_tracking); two
    # warm-up steps include a backward with the optimizer's moments already allocated.
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--format", default="table", choices=("table", "json"))
    p.add_argument("-o", "--output", type=Path)
    p.add_argument("--from-json", type=Path, action="append",
                   help="render the table of earlier --format json runs (repeatable: their rows are joined)")
    p.add_argument("--reestimate", action="store_true",
                   help="with --from-json: recompute the estimates with the current estimator (measurements kept)")
    args = p.parse_args(argv)
    if args.from_json:
        docs = [json.loads(path.read_text()) for path in args.from_json]
        rows = sorted((r for d in docs for r in d["rows"]), key=lambda r: r["stage"])
        settings = dict(docs[0].get("args", vars(args)))
        settings["stages"] = ",".join(str(s) for s in sorted({r["stage"] for r in rows}))
        if args.reestimate:
            _reestimate(rows, settings)
        if args.format == "json":
            text = json.dumps({"nproc": docs[0]["nproc"], "args": settings, "rows": rows}, indent=2)
            (args.output.write_text(text + "\n") if args.output else print(text))
            return 0
        return render(rows, settings, args.output)

    from rich.console import Console

    from zeroplan import estimator, profiles
    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.runtime.probe import comparable_estimate
    from zeroplan.spec import ClusterSpec, Plan, TrainingSpec

    task = _task_module()
    # examples/lora_task.py lm_loss drops the model's logits when it returns the loss: the "plain"
    # loss (the Hugging Face loop's returned logits are not held through backward).
    training = TrainingSpec(precision="bf16", seq_len=args.seq_len, loss="plain")
    gpu, _ = profiles.default_gpu()
    cluster = ClusterSpec(gpus=args.nproc, gpus_per_node=args.nproc, gpu=gpu)
    base_args = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
                 "--seq-len", str(args.seq_len)]
    quant = "" if args.base_quant == "none" else f" {args.base_quant}"
    configs = [("full", 0, "")] + [
        (f"r{r} {t}{quant}", r, t) for t in args.targets.split(";") for r in (int(x) for x in args.ranks.split(","))
    ]
    rows = []
    console = Console(stderr=True)
    for stage in (int(s) for s in args.stages.split(",")):
        plan = Plan(stage=stage, micro_batch=args.micro_batch)
        for label, rank, targets in configs:
            script_args = base_args + ["--rank", str(rank)] + (["--targets", targets] if targets else [])
            if rank and args.base_quant != "none":
                script_args += ["--base-quant", args.base_quant]
            spec = task.model_spec(task.parse_args(script_args))
            console.print(f"probing z{stage} {label} …")
            result = run_probe(ProbeRequest(script=ROOT / "examples" / "lora_task.py", nproc=args.nproc, plan=plan,
                                            training=training, script_args=tuple(script_args), steps=args.steps,
                                            warmup=args.warmup, timeout_s=args.timeout, backend=args.backend))
            on_cpu = result.memory_kind != "cuda"
            est = estimator.estimate_plan(spec, cluster, training, plan, device="cpu" if on_cpu else "cuda", engine=args.backend)
            rows.append({
                "stage": stage, "config": label, "rank": rank, "targets": targets or "—",
                "trainable_params": spec.trainable_params, "total_params": spec.total_params,
                "status": result.status, "error": result.error,
                "estimated_peak": comparable_estimate(est, on_cpu=on_cpu, ranks_per_node=args.nproc),
                "measured_peak": max(result.peak_memory_per_rank) if result.peak_memory_per_rank else None,
                "memory_kind": result.memory_kind,
            })
    _savings(rows)

    if args.format == "json":
        settings = {k: v for k, v in vars(args).items() if k not in ("output", "from_json", "format")}
        text = json.dumps({"nproc": args.nproc, "args": settings, "rows": rows}, indent=2)
        (args.output.write_text(text + "\n") if args.output else print(text))
        return 0 if all(r["status"] == "ok" for r in rows) else 1
    return render(rows, vars(args), args.output)


def _savings(rows: list[dict]) -> None:
    full = {r["stage"]: r for r in rows if r["config"] == "full"}
    for r in rows:
        f = full[r["stage"]]
        r["saving_predicted"] = 1 - r["estimated_peak"] / f["estimated_peak"]
        r["saving_measured"] = (1 - r["measured_peak"] / f["measured_peak"]) if r["measured_peak"] and f["measured_peak"] else None


def _reestimate(rows: list[dict], settings: dict) -> None:
    """The current estimator's comparable peak for each measured row (same model, plan, engine)."""
    from zeroplan import estimator, profiles
    from zeroplan.runtime.probe import comparable_estimate
    from zeroplan.spec import ClusterSpec, Plan, TrainingSpec

    task = _task_module()
    gpu, _ = profiles.default_gpu()
    cluster = ClusterSpec(gpus=settings["nproc"], gpus_per_node=settings["nproc"], gpu=gpu)
    training = TrainingSpec(precision="bf16", seq_len=settings["seq_len"], loss="plain")  # lm_loss drops the logits
    for r in rows:
        script_args = ["--layers", str(settings["layers"]), "--hidden", str(settings["hidden"]), "--vocab", str(settings["vocab"]),
                       "--seq-len", str(settings["seq_len"]), "--rank", str(r["rank"])]
        if r["rank"]:
            script_args += ["--targets", r["targets"], "--base-quant", settings.get("base_quant", "none")]
        spec = task.model_spec(task.parse_args(script_args))
        on_cpu = r["memory_kind"] != "cuda"
        est = estimator.estimate_plan(spec, cluster, training, Plan(stage=r["stage"], micro_batch=settings["micro_batch"]),
                                      device="cpu" if on_cpu else "cuda", engine=settings.get("backend", "deepspeed"))
        r["estimated_peak"] = comparable_estimate(est, on_cpu=on_cpu, ranks_per_node=settings["nproc"])
    _savings(rows)


def render(rows: list[dict], args: dict, output: Path | None) -> int:
    from rich.console import Console
    from rich.table import Table

    out = Console(file=output.open("w") if output else None, width=150)
    first = rows[0]
    table = Table(
        title=(f"{'PyTorch DDP/FSDP2' if args.get('backend') == 'fsdp' else 'DeepSpeed'} on {args['nproc']} ranks: Llama L{args['layers']} h{args['hidden']} V{args['vocab']} "
               f"s{args['seq_len']} (base Ψ = {first['total_params']:,}), micro-batch {args['micro_batch']}, bf16; "
               "peak MiB per rank"),
        title_justify="left",
    )
    for col in ("stage", "config", "trainable", "peak est", "peak meas", "err", "saving pred", "saving meas"):
        table.add_column(col, justify="left" if col == "config" else "right")
    mib = lambda n: f"{n / 2**20:,.2f}"  # noqa: E731
    for r in rows:
        if r["status"] != "ok":
            table.add_row(str(r["stage"]), r["config"], f"{r['trainable_params']:,}", mib(r["estimated_peak"]), r["status"], "", "", "")
            continue
        table.add_row(
            str(r["stage"]), r["config"], f"{r['trainable_params']:,}", mib(r["estimated_peak"]), mib(r["measured_peak"]),
            f"{(r['estimated_peak'] - r['measured_peak']) / r['measured_peak']:+.1%}",
            f"{r['saving_predicted']:.1%}", f"{r['saving_measured']:.1%}" if r["saving_measured"] is not None else "—",
        )
    out.print(table)
    if first["memory_kind"] == "cpu-storage":
        out.print("measured: live tensor storage per rank (CPU run, DS_ACCELERATOR=cpu, gloo); estimate with device=cpu")
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
