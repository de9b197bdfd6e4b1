"""Per-rank peak memory of parallel layouts, measured by probes on the real engine, beside the estimator.

    PYTHONPATH=. python benchmarks/bench_layout_memory.py                       # CPU: live tensor storage
    PYTHONPATH=. python benchmarks/bench_layout_memory.py --repeats 2 -o benchmarks/results/layout_memory.txt \
        --json benchmarks/results/layout_memory.json
    PYTHONPATH=. python benchmarks/bench_layout_memory.py --from-json benchmarks/results/layout_memory.json   # re-estimate only

A tiny Llama (examples/tiny_llama/config.json, random weights) in a plain DeepSpeed loop
(examples/train_hf_causal_lm.py), ZeRO-1, micro batch 1, fp32, on ``--nproc`` ranks for every
layout, so the world and the ZeRO partition of the model states stay the same and what changes is
the layout: Ulysses sp ∈ {1, 2, 4} (each rank holds seq/sp tokens), AutoTP tp ∈ {1, 2}, and
DeepSpeed's TiledMLP (the MLP in ceil(seq / hidden) tiles, recomputed in backward) at sp 1 and 2.

Per layout it prints the measured peak per rank (max, and the spread over ranks and repeats), the
estimator's comparable figure for the same Plan (``estimate_plan`` + ``comparable_estimate``, as
bench_probe_memory.py; a Plan's sp/tp/tiled_mlp reach the estimator through the Plan), and the
sp=2/sp=1 and tiled/untiled ratios measured and estimated. Reduce and all-gather buckets are h²
elements (Hugging Face's "auto"), so the buckets do not hide the activations. The loss is
estimated as ``plain``: the script writes ``loss = engine(input_ids=..., labels=...).loss``, so the
model's output, logits included, is dropped before backward (``hf`` counts those logits held).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCRIPT = ROOT / "examples" / "train_hf_causal_lm.py"
MODEL = ROOT / "examples" / "tiny_llama" / "config.json"
#: name -> (sp, tp, TiledMLP)
LAYOUTS = {
    "sp1": (1, 1, False),
    "sp2": (2, 1, False),
    "sp4": (4, 1, False),
    "tp2": (1, 2, False),
    "sp1+tiled": (1, 1, True),
    "sp2+tiled": (2, 1, True),
}


def _load() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def measure(name: str, args, model, training, cluster) -> dict:
    from zeroplan.runtime import ProbeRequest, run_probe

    sp, tp, tiled = LAYOUTS[name]
    plan = layout_plan(name, stage=args.stage, hidden=model.hidden_size)
    script_args = ("--model-config", str(MODEL.parent), "--seq-len", str(args.seq_len)) + (("--tiled-mlp",) if tiled else ())
    peaks, step_times, errors = [], [], []
    for _ in range(args.repeats):
        result = run_probe(ProbeRequest(script=SCRIPT, nproc=args.nproc, plan=plan, training=training, model=model,
                                        script_args=script_args, steps=args.steps, warmup=args.warmup, timeout_s=args.timeout,
                                        seq_len=args.seq_len))
        if result.status != "ok":
            errors.append(f"{result.status}: {result.error}")
            continue
        peaks.append(list(result.peak_memory_per_rank))
        step_times.append(result.step_time)
    return {"layout": name, "sp": sp, "tp": tp, "tiled_mlp": tiled, "plan": plan.label_for("deepspeed"),
            "measured_peak_per_rank": peaks, "step_time_s": step_times, "errors": errors,
            "estimated_peak": estimate(name, stage=args.stage, nproc=args.nproc, model=model, training=training, cluster=cluster)}


def layout_plan(name: str, *, stage: int, hidden: int):
    from zeroplan.spec import Plan

    sp, tp, tiled = LAYOUTS[name]
    return Plan(stage=stage, micro_batch=1, sp=sp, tp=tp, tiled_mlp=tiled, reduce_bucket_size=hidden ** 2, allgather_bucket_size=hidden ** 2)


def estimate(name: str, *, stage: int, nproc: int, model, training, cluster) -> int:
    """The estimator's comparable per-rank peak for the layout's Plan (TiledMLP rows with
    ``Plan.tiled_mlp``)."""
    from zeroplan import estimator
    from zeroplan.runtime.measure.prediction import comparable_estimate

    plan = layout_plan(name, stage=stage, hidden=model.hidden_size)
    est = estimator.estimate_plan(model, cluster, training, plan, device="cpu")
    return comparable_estimate(est, on_cpu=True, ranks_per_node=nproc)


def tiled_mlp_saving_bytes(model, *, seq_len: int, sp: int, dtype_bytes: int = 4) -> int:
    """What TiledMLP frees per rank: the MLP intermediates autograd keeps for backward, per layer
    gate_proj's output (SiLU's input), SiLU's output and up_proj's output (the product's inputs)
    and their product (down_proj's input): 4 × tokens × ffn elements (torch saves them for
    silu/mul/linear backward; TiledMLP keeps only the MLP input, ulysses_sp.py TiledMLP.forward
    runs the shards under no_grad and recomputes them in backward)."""
    return model.num_layers * 4 * (seq_len // sp) * model.ffn_size * dtype_bytes


def _ratio(rows: dict, a: str, b: str, key: str) -> float | None:
    if a not in rows or b not in rows:
        return None
    num, den = rows[a].get(key), rows[b].get(key)
    return num / den if num and den else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--format", default="table", choices=("table", "json"))
    p.add_argument("-o", "--output", type=Path)
    p.add_argument("--json", type=Path, help="also write the raw results (every rank, every run) as JSON here")
    p.add_argument("--from-json", type=Path, help="no probes: re-read a --json file and estimate its layouts with the current estimator")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    if unknown := [n for n in names if n not in LAYOUTS]:
        p.error(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    if bad := [n for n in names if args.nproc % (LAYOUTS[n][0] * LAYOUTS[n][1])]:
        p.error(f"layouts {bad} do not divide --nproc {args.nproc}")

    from rich.console import Console
    from rich.table import Table

    from zeroplan import profiles
    from zeroplan.spec import ClusterSpec, TrainingSpec

    model = profiles.model_from_hf_config(MODEL)
    training = TrainingSpec(precision="fp32", seq_len=args.seq_len, loss="plain")
    gpu, _ = profiles.default_gpu()
    cluster = ClusterSpec(gpus=args.nproc, gpus_per_node=args.nproc, gpu=gpu)
    load_before, started = _load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    rows = {}
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        for key in ("seq_len", "nproc", "stage", "repeats"):
            setattr(args, key, saved[key])
        training = TrainingSpec(precision="fp32", seq_len=args.seq_len, loss="plain")
        cluster = ClusterSpec(gpus=args.nproc, gpus_per_node=args.nproc, gpu=gpu)
        load_before, started = saved["load_before"], saved["date"]
        for row in saved["layouts"]:
            row["estimated_peak"] = estimate(row["layout"], stage=args.stage, nproc=args.nproc, model=model, training=training, cluster=cluster)
            rows[row["layout"]] = row
    for name in [] if args.from_json else names:
        print(f"probing {name} ...", file=sys.stderr, flush=True)
        row = measure(name, args, model, training, cluster)
        flat = [x for run in row["measured_peak_per_rank"] for x in run]
        row["measured_peak"] = max(flat) if flat else None
        row["measured_spread"] = (max(flat) - min(flat)) / max(flat) if flat else None
        rows[name] = row
    ratios = {
        "sp2/sp1": (_ratio(rows, "sp2", "sp1", "measured_peak"), _ratio(rows, "sp2", "sp1", "estimated_peak")),
        "sp4/sp1": (_ratio(rows, "sp4", "sp1", "measured_peak"), _ratio(rows, "sp4", "sp1", "estimated_peak")),
        "tp2/sp1": (_ratio(rows, "tp2", "sp1", "measured_peak"), _ratio(rows, "tp2", "sp1", "estimated_peak")),
        "tiled/untiled sp1": (_ratio(rows, "sp1+tiled", "sp1", "measured_peak"), _ratio(rows, "sp1+tiled", "sp1", "estimated_peak")),
        "tiled/untiled sp2": (_ratio(rows, "sp2+tiled", "sp2", "measured_peak"), _ratio(rows, "sp2+tiled", "sp2", "estimated_peak")),
    }
    meta = {"date": started, "load_before": load_before, "load_after": saved["load_after"] if args.from_json else _load(), "nproc": args.nproc, "seq_len": args.seq_len,
            "stage": args.stage, "repeats": args.repeats, "model": model.as_dict()}
    text = json.dumps({**meta, "layouts": list(rows.values()), "ratios": ratios}, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    if args.format == "json":
        (args.output.write_text(text + "\n") if args.output else print(text))
        return 0 if all(not r["errors"] for r in rows.values()) else 1

    out = Console(file=args.output.open("w") if args.output else None, width=150)
    table = Table(title=(f"{started}, load {meta['load_before']} → {meta['load_after']}: tiny Llama (Ψ = {model.params:,}), "
                         f"{args.nproc} CPU ranks, ZeRO-{args.stage}, s = {args.seq_len}, micro batch 1, fp32, "
                         f"{args.repeats} run(s) each; MiB per rank"), title_justify="left")
    for col in ("layout", "plan", "peak measured (max)", "spread", "peak estimated", "error", "step s"):
        table.add_column(col, justify="left" if col in ("layout", "plan") else "right")
    mib = lambda n: "—" if n is None else f"{n / 2**20:,.1f}"  # noqa: E731
    for r in rows.values():
        meas, est = r["measured_peak"], r["estimated_peak"]
        table.add_row(r["layout"], r["plan"], mib(meas), "—" if r["measured_spread"] is None else f"{r['measured_spread']:.1%}",
                      mib(est), "—" if not meas else f"{(est - meas) / meas:+.1%}",
                      f"{min(r['step_time_s']):.3f}" if r["step_time_s"] else "; ".join(r["errors"])[:60])
    out.print(table)
    ratio_table = Table(title="ratios of per-rank peaks", title_justify="left")
    for col in ("ratio", "measured", "estimated", "difference"):
        ratio_table.add_column(col, justify="left" if col == "ratio" else "right")
    for name, (meas, est) in ratios.items():
        if meas is None and est is None:
            continue
        fmt = lambda x: "—" if x is None else f"{x:.3f}"  # noqa: E731
        ratio_table.add_row(name, fmt(meas), fmt(est), "—" if meas is None or est is None else f"{est - meas:+.3f}")
    out.print(ratio_table)
    for sp_name, tiled_name in (("sp1", "sp1+tiled"), ("sp2", "sp2+tiled")):
        if rows.get(sp_name, {}).get("measured_peak") and rows.get(tiled_name, {}).get("measured_peak"):
            saved_bytes = rows[sp_name]["measured_peak"] - rows[tiled_name]["measured_peak"]
            expected = tiled_mlp_saving_bytes(model, seq_len=args.seq_len, sp=rows[sp_name]["sp"])
            out.print(f"TiledMLP at {sp_name}: saves {saved_bytes / 2**20:,.2f} MiB per rank; the MLP intermediates autograd keeps, "
                      f"layers × 4 × tokens × ffn × 4 B = {expected / 2**20:,.2f} MiB ({(expected - saved_bytes) / saved_bytes:+.1%})")
    out.print("measured: live tensor storage per rank (CPU run, DS_ACCELERATOR=cpu); spread: (max - min) / max over ranks and runs")
    return 0 if all(not r["errors"] for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
