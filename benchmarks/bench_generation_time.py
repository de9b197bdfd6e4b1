"""GRPO generation time: the estimator's generation term against TRL's own generation on CPU.

Runs examples/train_trl_grpo.py (tiny Llama, HF ``generate``, no vLLM) under torchrun on 1–2 CPU
ranks (gloo) with DeepSpeed ZeRO-2 and ZeRO-3, at two completion lengths, with ZeRO-3's
``ds3_gather_for_generation`` on (TRL's default: one whole-model gather per generate call,
trl/models/utils.py:142-149) and off (DeepSpeed's hooks gather every layer in every forward, i.e.
per token). Each call of ``GRPOTrainer._generate_single_turn`` is timed by
benchmarks/grpo_generation_timer.py; the first call is warm-up and dropped.

Absolute CPU seconds are not the question (the estimator's roofline is for the GPU preset); the
*ratios* are: long / short completions, ZeRO-3 / ZeRO-2, and gather-off / gather-on. The table
sets them beside :func:`zeroplan.estimator.generation_time.generation_time` evaluated with a
calibrated CPU profile of this VM (``--profile``; its ``stage3_layer_overhead_s`` prices the
hooks of a ZeRO-3 forward).

    python benchmarks/bench_generation_time.py            # run (about 10 min on 2 busy cores)
    python benchmarks/bench_generation_time.py --from-json benchmarks/results/generation_time.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
TIMER = ROOT / "benchmarks" / "grpo_generation_timer.py"
#: A ``zeroplan calibrate --device cpu --gpus 2`` profile of this VM, when one is saved here.
PROFILE = RESULTS / "generation_time_cpu_profile.toml"

#: (ranks, stage, completion tokens, ds3_gather_for_generation)
RUNS = [(1, 2, 16, True), (1, 2, 64, True), (2, 2, 16, True), (2, 2, 64, True),
        (2, 3, 16, True), (2, 3, 64, True), (2, 3, 16, False), (2, 3, 64, False)]


def _ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}},
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}


def run_one(ranks: int, stage: int, completion: int, gather: bool, *, tmp: Path, steps: int, prompt_len: int) -> dict:
    cfg = tmp / f"z{stage}.json"
    cfg.write_text(json.dumps(_ds_config(stage)))
    out = tmp / f"r{ranks}z{stage}L{completion}g{int(gather)}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "GEN_TIMER_OUT": str(out), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(29600 + stage * 10 + ranks),
           str(TIMER), "--deepspeed", str(cfg), "--use_cpu", "--report_to", "none", "--output_dir", str(tmp / "out"),
           "--num_generations", "2", "--per_device_train_batch_size", "2", "--max_completion_length", str(completion),
           "--prompt_len", str(prompt_len), "--max_steps", str(steps), "--save_strategy", "no", "--logging_steps", "100",
           "--ds3_gather_for_generation", str(gather)]
    start = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    calls = []
    for rank in range(ranks):
        f = Path(f"{out}.rank{rank}.json")
        if f.exists():
            calls.append(json.loads(f.read_text()))
    row = {"ranks": ranks, "stage": stage, "completion_len": completion, "gather_for_generation": gather, "rc": r.returncode,
           "wall_s": round(time.time() - start, 1), "calls_per_rank": calls}
    if r.returncode != 0:
        row["error"] = (r.stderr.strip().splitlines() or ["no output"])[-1]
    return row


def measured_s(row: dict) -> list[float]:
    """Per timed call (warm-up dropped), the slowest rank's seconds (the ranks wait for each other after)."""
    per_rank = [[c["seconds"] for c in calls[1:]] for calls in row["calls_per_rank"]]
    return [max(t) for t in zip(*per_rank)] if per_rank else []


def stage3_layer_overhead_s(text: str) -> float:
    """``stage3_layer_overhead_s`` from a calibrate run's engine lines (``calibrate engine zN: ... ->
    fixed F s (model's own M s)``) as ``zeroplan calibrate`` derives it (calibrate/run.py:394-406):
    stage 3's fixed cost beyond the model's own, less the median of the other stages', per layer of
    the calibration GPT (``L<layers>`` in the table's title)."""
    extra = {int(m[1]): float(m[2]) - float(m[3]) for m in re.finditer(r"engine z(\d): .*?fixed ([\d.]+) s \(model's own ([\d.]+) s\)", text)}
    layers = int(re.search(r"\(\S+ params, L(\d+) ", text)[1])
    return (extra[3] - statistics.median(v for k, v in extra.items() if k != 3)) / layers


def cpu_cluster(ranks: int, profile: Path | None):
    """This VM as the estimator sees it: ``profile`` (a ``zeroplan calibrate --device cpu`` TOML),
    else the calibrated CPU profile saved in benchmarks/results/time_model.json with the ZeRO-3
    per-layer cost of the same calibration (time_model.txt's engine lines)."""
    from zeroplan.profiles import resolve_cluster
    from zeroplan.spec import ClusterSpec, GpuSpec

    if profile is not None:
        return resolve_cluster(gpus=ranks, gpus_per_node=ranks, gpu=str(profile), gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    gpu = GpuSpec(**json.loads((RESULTS / "time_model.json").read_text())["profile"])
    gpu = dataclasses.replace(gpu, stage3_layer_overhead_s=stage3_layer_overhead_s((RESULTS / "time_model.txt").read_text()))
    return ClusterSpec(gpus=ranks, gpus_per_node=ranks, gpu=gpu, gpu_memory_bytes=gpu.memory_bytes)


def predicted(row: dict, profile: Path | None):
    from zeroplan.estimator.generation_time import generation_time
    from zeroplan.profiles.hf_config import model_from_hf_config

    model = model_from_hf_config(ROOT / "examples" / "tiny_llama.json")
    return generation_time(model, cpu_cluster(row["ranks"], profile), sequences=2, prompt_len=row["calls_per_rank"][0][0]["prompt_tokens"],
                           completion_len=row["completion_len"], precision="fp32", stage=row["stage"],
                           gather_for_generation=row["gather_for_generation"])


def table(doc: dict, profile: Path | None) -> list[str]:
    settings = doc["settings"]
    lines = [f"GRPO generation time on CPU ({doc['date']}, load before {doc['load_before']}, after {doc['load_after']}): "
             f"tiny Llama, G=2, 2 sequences per rank, prompt {settings['prompt_words']} words, gloo; "
             f"{settings['steps'] - 1} timed calls per run (the first dropped), the slowest rank's",
             f"predicted with {profile or 'benchmarks/results/time_model.json (profile) and time_model.txt (ZeRO-3 per-layer cost: %.4f s)' % cpu_cluster(1, None).gpu.stage3_layer_overhead_s}",
             f"{'ranks':>5} {'stage':>5} {'L':>4} {'gather':>6} {'median s':>9} {'min s':>7}  runs s{'':<26} {'predicted s':>11}"]
    med, pred = {}, {}
    for row in doc["rows"]:
        m = measured_s(row)
        key = (row["ranks"], row["stage"], row["completion_len"], row["gather_for_generation"])
        if not m:
            lines.append(f"{key[0]:>5} {key[1]:>5} {key[2]:>4} {str(key[3]):>6} {'failed: ' + row.get('error', '')[:60]}")
            continue
        med[key], pred[key] = statistics.median(m), predicted(row, profile)
        runs = " ".join(f"{x:.2f}" for x in m)
        lines.append(f"{key[0]:>5} {key[1]:>5} {key[2]:>4} {str(key[3]):>6} {med[key]:>9.3f} {min(m):>7.3f}  {runs:<32} {pred[key].total_s:>11.4f}")
    lines += ["", "ratios of medians (measured vs predicted):"]
    pairs = [("L64/L16, 1 rank z2", (1, 2, 64, True), (1, 2, 16, True)),
             ("L64/L16, 2 ranks z2", (2, 2, 64, True), (2, 2, 16, True)),
             ("L64/L16, 2 ranks z3", (2, 3, 64, True), (2, 3, 16, True)),
             ("L64/L16, z3 gather off", (2, 3, 64, False), (2, 3, 16, False)),
             ("z3/z2 L16, 2 ranks", (2, 3, 16, True), (2, 2, 16, True)),
             ("z3/z2 L64, 2 ranks", (2, 3, 64, True), (2, 2, 64, True)),
             ("z3 gather off/on L16", (2, 3, 16, False), (2, 3, 16, True)),
             ("z3 gather off/on L64", (2, 3, 64, False), (2, 3, 64, True))]
    for name, a, b in pairs:
        if a in med and b in med:
            lines.append(f"  {name:<24} measured {med[a] / med[b]:6.2f}   predicted {pred[a].total_s / pred[b].total_s:6.2f}")
    lines += ["", "ZeRO-3 hooks left on (gather off) minus TRL's one gather, per forward (prefill + L-1 decodes), seconds:"]
    for length in (16, 64):
        off, on = (2, 3, length, False), (2, 3, length, True)
        if off in med and on in med:
            p = pred[off]
            lines.append(f"  L{length}: measured {(med[off] - med[on]) / length:.4f}   predicted {(p.gather_s + p.engine_s - pred[on].gather_s) / length:.4f} "
                         f"(gathers {p.gather_s / length:.4f}, engine hooks {p.engine_s / length:.4f})")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from-json", type=Path)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--out", type=Path, default=RESULTS / "generation_time.json")
    ap.add_argument("--profile", type=Path, default=PROFILE if PROFILE.exists() else None,
                    help="calibrated CPU profile (TOML) for the predictions [default: %(default)s]")
    args = ap.parse_args()
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
    else:
        load_before = os.getloadavg()[0]
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            for run in RUNS:
                rows.append(run_one(*run, tmp=Path(tmp), steps=args.steps, prompt_len=args.prompt_len))
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "calls_per_rank"}), flush=True)
        doc = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_before": round(load_before, 1),
               "load_after": round(os.getloadavg()[0], 1), "settings": {"prompt_words": args.prompt_len, "steps": args.steps},
               "rows": rows}
        args.out.write_text(json.dumps(doc, indent=1))
    lines = table(doc, args.profile)
    print("\n".join(lines))
    args.out.with_suffix(".txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
