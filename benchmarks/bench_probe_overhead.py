"""Does measuring change what is measured? Step time of the same DeepSpeed script bare vs under a probe.

    PYTHONPATH=. python benchmarks/bench_probe_overhead.py [--rounds 5] [-o benchmarks/results/probe_overhead.txt]

``benchmarks/host_memory_script.py`` (the example GPT) runs on 2 CPU ranks (gloo) with the same
DeepSpeed config, alternately bare under ``torchrun`` (the script times its own steps, from one
optimizer step's end to the next, exactly where the probe's meter times them) and under
``zeroplan.runtime.run_probe`` (memory tracker, host RSS sampler, step meter attached). Rounds are
interleaved so drift in the machine's load hits both alike; per run the statistic is the median
step time of the slower rank, and the table gives the median over rounds and their ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCRIPT = ROOT / "benchmarks" / "host_memory_script.py"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--no-tracked", action="store_true", help="leave out the tracked arm (halves the run)")
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt_task

    from zeroplan.dsconfig import build_config
    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.runtime.probe import probe_environment
    from zeroplan.spec import Plan, TrainingSpec

    cfg = gpt_task.GPTConfig(layers=args.layers, hidden=args.hidden, heads=8, vocab=args.vocab, seq_len=64)
    model = gpt_task.model_spec(cfg)
    training = TrainingSpec(precision="bf16", seq_len=64)
    plan = Plan(stage=args.stage, micro_batch=2)
    ds = build_config(plan, world_size=2, training=training, model=model)
    tmp = Path(tempfile.mkdtemp(prefix="zeroplan-overhead-"))
    cfg_path = tmp / "ds.json"
    cfg_path.write_text(json.dumps(ds))
    size_args = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab)]
    request = ProbeRequest(script=SCRIPT, nproc=2, ds_config=ds, model=model, training=training, script_args=tuple(size_args),
                           steps=args.steps, warmup=args.warmup, timeout_s=900)
    env = probe_environment(request) | {"DS_ACCELERATOR": "cpu"}

    def stat(per_rank: list[dict]) -> tuple[float, float]:
        """(slower rank's median wall s, slower rank's median CPU s) per step."""
        return (max(statistics.median(r["step_times"]) for r in per_rank),
                max(statistics.median(r["step_cpu_times"]) for r in per_rank))

    def bare() -> tuple[float, float]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT), *size_args,
               "--deepspeed_config", str(cfg_path), "--bare-steps", str(args.steps), "--bare-warmup", str(args.warmup)]
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        ranks = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("BARE_STEP_TIMES ")]
        if len(ranks) != 2:
            raise RuntimeError(f"bare run failed: {out.stdout[-2000:]}{out.stderr[-2000:]}")
        return stat(ranks)

    def probed(*, track_all: bool = False) -> tuple[float, float]:
        # track_all: --warmup 0, so the memory tracker stays on through every timed step (how every
        # probe ran before it stopped at the end of warm-up); the first `warmup` steps are dropped.
        req = request if not track_all else dataclasses.replace(request, warmup=0, steps=args.warmup + args.steps)
        r = run_probe(req)
        if r.status != "ok":
            raise RuntimeError(f"probe failed: {r.error}")
        ranks = [json.loads(f.read_text()) for f in sorted(Path(r.workdir).glob("rank-*.json"))]
        if track_all:
            ranks = [{k: r[k][args.warmup:] for k in ("step_times", "step_cpu_times")} for r in ranks]
        return stat(ranks)

    arms = {"bare": bare, "probe": probed, "tracked": lambda: probed(track_all=True)}
    if args.no_tracked:
        del arms["tracked"]
    rows = []
    for i in range(args.rounds):
        order = list(arms)[i % len(arms):] + list(arms)[: i % len(arms)]  # rotate who goes first
        got = {name: arms[name]() for name in order}
        row = {"round": i}
        for name, (wall, cpu) in got.items():
            row[f"{name}_s"], row[f"{name}_cpu_s"] = wall, cpu
        rows.append(row)
        print(f"round {i}: " + ", ".join(f"{n} {row[n + '_s'] * 1e3:.1f} ms ({row[n + '_cpu_s'] * 1e3:.1f} CPU)" for n in arms), file=sys.stderr)

    def ratios(arm: str, kind: str = "") -> list[float]:
        return [r[f"{arm}{kind}_s"] / r[f"bare{kind}_s"] for r in rows] if f"{arm}{kind}_s" in rows[0] else [float("nan")]

    def ratio(arm: str, kind: str = "") -> float:
        return statistics.median(ratios(arm, kind))

    def spread(arm: str, kind: str = "") -> str:
        got = ratios(arm, kind)
        return f"{min(got):.2f}-{max(got):.2f}"

    nan = float("nan")
    for r in rows:
        r.setdefault("tracked_s", nan)
        r.setdefault("tracked_cpu_s", nan)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "round"}
    lines = [
        f"Step time, bare DeepSpeed script vs the same under run_probe: ZeRO-{args.stage}, 2 CPU ranks (gloo), GPT L{args.layers} "
        f"h{args.hidden} V{args.vocab} (Ψ = {model.params:,}), bf16, micro-batch 2; {args.rounds} interleaved rounds, "
        f"{args.warmup} warm-up + {args.steps} timed steps each; per run the slower rank's median step.",
        f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (shared machine: treat small differences as noise)",
        "",
        "bare: the script alone; probe: under run_probe (memory tracker off after warm-up); tracked: under run_probe with",
        "--warmup 0, so the tracker watches every timed step (how probes ran before). wall: step wall time; CPU: CPU seconds",
        "of the rank process per step (all threads), less disturbed by other jobs. Ratios: median of per-round ratios to bare.",
        "",
        f"{'round':>6} {'bare ms':>9} {'probe ms':>9} {'tracked ms':>11} {'bare CPU':>9} {'probe CPU':>10} {'tracked CPU':>12}",
        *[f"{r['round']:>6} {r['bare_s'] * 1e3:>9.1f} {r['probe_s'] * 1e3:>9.1f} {r['tracked_s'] * 1e3:>11.1f} "
          f"{r['bare_cpu_s'] * 1e3:>9.1f} {r['probe_cpu_s'] * 1e3:>10.1f} {r['tracked_cpu_s'] * 1e3:>12.1f}" for r in rows],
        f"{'median':>6} {med['bare_s'] * 1e3:>9.1f} {med['probe_s'] * 1e3:>9.1f} {med['tracked_s'] * 1e3:>11.1f} "
        f"{med['bare_cpu_s'] * 1e3:>9.1f} {med['probe_cpu_s'] * 1e3:>10.1f} {med['tracked_cpu_s'] * 1e3:>12.1f}",
        f"{'ratio':>6} {1:>9.3f} {ratio('probe'):>9.3f} {ratio('tracked'):>11.3f} {1:>9.3f} {ratio('probe', '_cpu'):>10.3f} "
        f"{ratio('tracked', '_cpu'):>12.3f}",
        f"{'range':>6} {'':>9} {spread('probe'):>9} {spread('tracked'):>11} {'':>9} {spread('probe', '_cpu'):>10} "
        f"{spread('tracked', '_cpu'):>12}   (min-max of the per-round ratios)",
    ]
    text = "\n".join(lines) + "\n"
    if args.output:
        args.output.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
