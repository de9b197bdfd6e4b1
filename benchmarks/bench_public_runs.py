"""zeroplan's estimate against training runs reported in public (benchmarks/public_runs.json).

Each row of the table is a run someone published — a tutorial, a benchmark table, a paper, an
OOM report — with its setting and what happened: it fit or ran out of memory, and sometimes its
peak memory. For each row this runs the estimator through the library calls `zeroplan estimate`
makes (resolve_model, with_peft, resolve_cluster, resolve_training, bucket_sizes,
enumerate_plans, estimate_all) with the engine, optimizer implementation, loss and bucket
convention the row implies, and prints estimate vs reported: fits/OOM agreement, and for rows
with a reported peak the error of the comparable figure (``reserved`` rows: ``gpu.peak_reserved``;
``allocated``: ``gpu.peak_allocated``; ``nvidia-smi``: ``gpu.total``). Fits/OOM is decided on
``gpu.required``: the cached segments the allocator frees before raising an OOM do not count.
A row whose process was killed for host RAM (``oom_kind: host``) is judged on the verdict that
weighs host RAM too, with the node's RAM the row states (``cpu_memory_gib``). Rows split by source
(``split``: tuning or heldout, rule in the table's ``about``) are also scored per half, beside the
score of answering "fits" every time.

It also runs against older zeroplan code (PYTHONPATH=<older checkout>): an option that code
lacks falls back to its default, and the row's ``fallback`` column says which.

    PYTHONPATH=. python benchmarks/bench_public_runs.py [--label after] [--json out.json]
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
from pathlib import Path

TABLE = Path(__file__).with_name("public_runs.json")
GiB = 1024**3


def load_rows(path: Path = TABLE) -> list[dict]:
    """The rows of the public-runs table."""
    return json.loads(path.read_text())["rows"]


def _accepts(fn, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def estimate_row(row: dict, workdir: Path) -> dict:
    """Estimate ``row``'s plan as `zeroplan estimate` would; what the estimator says and what it could not be told."""
    from dataclasses import fields, replace

    from zeroplan.cli import common
    from zeroplan.estimator import enumerate_plans, estimate_all

    try:
        from zeroplan.profiles.resolve import resolve_cluster, resolve_model
    except ImportError:  # older layout: the CLI's helpers
        resolve_cluster, resolve_model = common.resolve_cluster, common.resolve_model
    resolve_training, with_peft = common.resolve_training, common.with_peft
    from zeroplan.spec import CHECKPOINTING, TrainingSpec

    fallback: list[str] = []
    if "hf_config" in row:
        cfg = workdir / f"{row['id']}.json"
        cfg.write_text(json.dumps(row["hf_config"]))
        model_arg = str(cfg)
    else:
        model_arg = row["model"]
    lora = row.get("lora") or {}
    model = with_peft(
        resolve_model(None, model_arg), model_arg, precision=row["precision"], lora_rank=lora.get("rank"),
        lora_targets=lora.get("targets"), lora_alpha=None, adapter=None,
        # Adapters zeroplan cannot count module by module (LoRA on an encoder-decoder) are given
        # by their trainable-parameter count, as `--trainable-params` would.
        trainable_params=str(lora["trainable_params"]) if "trainable_params" in lora else None,
        base_quant=lora.get("base_quant"),
    )
    cluster = resolve_cluster(
        gpus=row["gpus"], gpus_per_node=row.get("gpus_per_node"), gpu=row["gpu"], gpu_memory_gib=row.get("gpu_memory_gib"),
        # Host RAM per node where the source states it (a host-OOM report); else the GPU's node profile.
        cpu_memory_gib=row.get("cpu_memory_gib"), nvme_gib=None,
    )
    training = resolve_training(
        precision=row["precision"], optimizer=row["optimizer"], seq_len=row["seq_len"], micro_batch=row["micro_batch"],
        global_batch=None, grad_accum=row.get("grad_accum", 1),
    )
    training = replace(training, flash_attention=row["flash_attention"])
    if "loss" in {f.name for f in fields(TrainingSpec)}:
        training = replace(training, loss=row["loss"])
    elif row["loss"] != "hf":
        fallback.append(f"loss {row['loss']}→hf")

    ckpt = row["checkpointing"]
    if ckpt not in CHECKPOINTING:
        # Older code named Korthikanti's attention recomputation "selective": what a user of that
        # version typed for torchtitan's selective AC too.
        old = "selective" if ckpt in ("selective-op", "attention") and "selective" in CHECKPOINTING else "none"
        fallback.append(f"ckpt {ckpt}→{old}")
        ckpt = old
    plan_kwargs: dict = {}
    est_kwargs: dict = {}
    engine = row.get("engine", "deepspeed")
    if _accepts(enumerate_plans, "engine"):
        plan_kwargs["engine"] = est_kwargs["engine"] = engine
    elif engine != "deepspeed":
        fallback.append(f"engine {engine}→deepspeed")
    impl = row.get("optimizer_impl")
    if impl is not None:
        if _accepts(enumerate_plans, "optimizer_impl"):
            plan_kwargs["optimizer_impl"] = est_kwargs["optimizer_impl"] = impl
        else:
            fallback.append(f"optimizer-impl {impl}→default")
    buckets = row.get("buckets", "hf")
    if _accepts(enumerate_plans, "buckets"):
        from zeroplan.estimator.plans import bucket_sizes

        # Sizes the source's DeepSpeed config sets explicitly (elements) win over the convention.
        plan_kwargs["buckets"] = bucket_sizes(buckets, **row.get("bucket_sizes", {}))
    elif buckets != "hf" or row.get("bucket_sizes"):
        fallback.append(f"buckets {buckets}→hf")
    if row.get("expandable_segments"):
        if _accepts(estimate_all, "expandable_segments"):
            est_kwargs["expandable_segments"] = True
        else:
            fallback.append("expandable_segments→off")
    plans = enumerate_plans(
        model, cluster, training, stage=row["stage"], offload_optimizer=row.get("offload_optimizer", "none"),
        offload_param=row.get("offload_param", "none"), checkpointing=ckpt, **plan_kwargs,
    )
    (est,) = estimate_all(model, cluster, training, plans, **est_kwargs)
    gpu = est.gpu.as_dict()
    context = est.overhead_items.get("cuda_context", 0)
    comparable = {
        "allocated": gpu["peak_allocated"],
        "reserved": gpu.get("peak_reserved", gpu["total"] - context),
        "nvidia-smi": gpu["total"],
    }
    return {
        # Public reports are GPU outcomes: compare the GPU verdict (est.fits also weighs host RAM,
        # where a per-rank fp32 model build can fail a run that builds on the meta device). The
        # verdict is on gpu.required (older code: gpu.total, cached segments included).
        "fits": gpu.get("required", gpu["total"]) <= cluster.gpu_memory_bytes,
        "fits_with_host": est.fits,
        "gpu_total": gpu["total"],
        "gpu_required": gpu.get("required", gpu["total"]),
        "gpu_memory": cluster.gpu_memory_bytes,
        "comparable": comparable,
        "fallback": fallback,
        "notes": list(est.notes),
    }


def evaluate(rows: list[dict]) -> list[dict]:
    """One result per row: the estimate, agreement, and the peak error where a peak was reported."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            est = estimate_row(row, Path(tmp))
            result = {"id": row["id"], "outcome": row["outcome"], **est}
            # A host OOM (the process killed for host RAM, oom_kind "host") is judged on the verdict
            # that weighs host RAM too; every other report on the GPU verdict.
            verdict = est["fits_with_host"] if row.get("oom_kind") == "host" else est["fits"]
            result["verdict_fits"] = verdict
            result["agree"] = (row["outcome"] == "fits") == verdict
            if row.get("reported_peak_gib") is not None:
                reported = row["reported_peak_gib"] * GiB
                predicted = est["comparable"][row["reported_kind"]]
                result["reported_peak"] = reported
                result["predicted_peak"] = predicted
                result["peak_error"] = (predicted - reported) / reported
            out.append(result)
    return out


def summary(results: list[dict]) -> dict:
    """Agreement % over every row and the median |error| over rows with a reported peak."""
    errors = [abs(r["peak_error"]) for r in results if "peak_error" in r]
    return {
        "rows": len(results),
        "agreement": sum(r["agree"] for r in results) / len(results),
        "peak_rows": len(errors),
        "median_abs_peak_error": statistics.median(errors) if errors else None,
    }


def render(rows: list[dict], results: list[dict], label: str) -> str:
    lines = [f"{label}: zeroplan estimate vs {len(rows)} public runs (benchmarks/public_runs.json)", ""]
    head = f"{'run':<40} {'GPUs':>9} {'reported':>9} {'estimate':>9} {'agree':>5} {'peak rep.':>9} {'peak est.':>9} {'error':>7}  fallback"
    lines += [head, "-" * len(head)]
    for row, r in zip(rows, results):
        gpus = f"{row['gpus']}x{r['gpu_memory'] / GiB:.0f}G"
        est = "fits" if r.get("verdict_fits", r["fits"]) else "oom"
        if "peak_error" in r:
            peak = f"{r['reported_peak'] / GiB:9.1f} {r['predicted_peak'] / GiB:9.1f} {r['peak_error']:+7.1%}"
        else:
            peak = f"{'':9} {r['gpu_required'] / GiB:9.1f} {'':>7}"
        lines.append(f"{row['id']:<40} {gpus:>9} {row['outcome']:>9} {est:>9} {'yes' if r['agree'] else 'NO':>5} {peak}  {', '.join(r['fallback'])}")
    s = summary(results)
    med = f"{s['median_abs_peak_error']:.1%}" if s["median_abs_peak_error"] is not None else "n/a"
    lines += [
        "",
        f"fits/OOM agreement: {sum(r['agree'] for r in results)}/{s['rows']} = {s['agreement']:.0%}; "
        f"median |peak error| over {s['peak_rows']} rows with a reported peak: {med}",
        "peak est. without a reported peak: what fits/OOM is decided on (gpu.required; gpu.total before it existed), GiB",
    ]
    # The rows split by source (public_runs.json `about`): each half beside the score of answering "fits" every time.
    for half in ("tuning", "heldout"):
        part = [(row, r) for row, r in zip(rows, results) if row.get("split") == half]
        if part:
            ooms = sum(row["outcome"] == "oom" for row, _ in part)
            missed = sum(row["outcome"] == "oom" and r["verdict_fits"] for row, r in part)
            lines.append(
                f"{half}: {sum(r['agree'] for _, r in part)}/{len(part)} agree; {ooms} reported OOM, {missed} of them called fits; "
                f"answering fits every time: {len(part) - ooms}/{len(part)}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="zeroplan " + _version())
    parser.add_argument("--json", type=Path, help="also write the per-row results as JSON")
    args = parser.parse_args(argv)
    rows = load_rows()
    results = evaluate(rows)
    print(render(rows, results, args.label))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary(results), "results": results}, indent=1))
    return 0


def _version() -> str:
    import zeroplan

    return getattr(zeroplan, "__version__", "?")


if __name__ == "__main__":
    sys.exit(main())
