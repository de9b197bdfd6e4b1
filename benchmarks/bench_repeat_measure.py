"""The same plan measured again: record probes' per-step time series, then compare measurement policies on them.

``record`` probes each plan of ``examples/train_deepspeed.py`` (1 rank, global batch 32) several
times, interleaved and in a rotated order each round, with the early stop off (every micro-step of
``--steps`` optimizer steps timed after the usual 2 warm-up steps), and saves every probe's micro-step
times with the machine's load before and after it:

    PYTHONPATH=. python benchmarks/bench_repeat_measure.py record --rounds 8 --out benchmarks/results/repeat_series.json

``analyze`` replays measurement policies (statistic, extra warm-up discarded, minimum steps, the stop
rule's target) on those series — each policy sees a prefix of a series, as a probe that stopped
there would — and prints, per policy, how far two measurements of the same plan disagree, what they
cost (measured optimizer steps), and whether the plans' ranking is that of the whole series. The
policy is chosen on one half of the probes (the first rounds) and reported on the other:

    PYTHONPATH=. python benchmarks/bench_repeat_measure.py analyze benchmarks/results/repeat_series.json

``tunes`` is the check as a user meets it: ``--repeat`` tunes of the example GPT, each plan the tune
measured twice compared, and a ``probe`` of the best plan right after against the tune's figure:

    PYTHONPATH=. python benchmarks/bench_repeat_measure.py tunes --repeat 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PLANS = {"z0/mb32/ga1": (32, 1), "z0/mb16/ga2": (16, 2), "z0/mb4/ga8": (4, 8)}


def record(args: argparse.Namespace) -> None:
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() and args.append else {"probes": []}
    tmp = Path(tempfile.mkdtemp(prefix="zeroplan-repeat-"))
    env = dict(os.environ, ZEROPLAN_PROBE_TARGET_CI="1e-9")  # micro-step timing, never stopping early
    keys = list(PLANS)
    first_round = 1 + max((p["round"] for p in data["probes"]), default=0)
    for r in range(first_round, first_round + args.rounds):
        order = keys[(r - 1) % len(keys):] + keys[: (r - 1) % len(keys)]
        for key in order:
            micro, accum = PLANS[key]
            work = tmp / f"r{r}-{key.replace('/', '_')}"
            cmd = [sys.executable, "-m", "zeroplan", "probe", str(ROOT / "examples" / "train_deepspeed.py"), "--gpus", "1", "--stage", "0",
                   "--micro-batch", str(micro), "--grad-accum", str(accum), "--steps", str(args.steps), "--warmup", "2",
                   "--workdir", str(work), "--", "--steps", str(args.steps + 4)]
            load0, t0 = os.getloadavg()[0], time.time()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            load1 = os.getloadavg()[0]
            try:
                rank = json.loads((work / "rank-0.json").read_text())
            except (OSError, ValueError):
                rank = {}
            ok = proc.returncode == 0 and rank.get("status") == "ok"
            data["probes"].append({
                "plan": key, "grad_accum": accum, "samples_per_step": rank.get("samples_per_step"), "round": r, "start_unix": round(t0, 1),
                "load_1m": [round(load0, 2), round(load1, 2)], "ok": ok,
                "micro_times": [round(x, 5) for x in rank.get("micro_times", [])],
                "boundary_times": [round(x, 5) for x in rank.get("boundary_times", [])],
                "step_cpu_times": [round(x, 5) for x in rank.get("step_cpu_times", [])],
                "micro_cpu_times": [round(x, 5) for x in rank.get("micro_cpu_times", [])],
            })
            print(f"round {r} {key:<12} {'ok' if ok else 'FAILED'} load {load0:.1f}-{load1:.1f} "
                  f"steps {len(rank.get('boundary_times', []))} median step {_median_step(data['probes'][-1]):.4f} s", flush=True)
            out.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")


def _median_step(p: dict) -> float:
    steps = step_series(p)
    return statistics.median(steps) if steps else float("nan")


def step_series(p: dict) -> list[float]:
    """Whole optimizer-step times: G − 1 micro-steps then the boundary one, in order."""
    g = p["grad_accum"]
    m, b = p["micro_times"], p["boundary_times"]
    return [sum(m[i * (g - 1):(i + 1) * (g - 1)]) + b[i] for i in range(min(len(b), len(m) // (g - 1) if g > 1 else len(b)))]


CANDIDATES = [
    *(
        (s, ci, n, mx, w)
        for s in ("mean", "median", "trimmed", "p25", "min")
        for ci in (0.1, 0.05, 0.03)
        for n in (2, 3, 4, 6)
        for mx in (5, 6, 8, 12)
        for w in (0, 1, 2)
        if n <= mx
    )
]


#: Two plans whose CPU time per step differs by less than this have no order to keep.
RANK_MARGIN = 0.05


def halves(probes: list[dict]) -> tuple[list[dict], list[dict], int]:
    """(first rounds, last rounds, first round of the second half): choose on one, report on the other."""
    rounds = sorted({p["round"] for p in probes})
    half = rounds[len(rounds) // 2] if len(rounds) > 1 else rounds[0] + 1
    return [p for p in probes if p["round"] < half], [p for p in probes if p["round"] >= half], half


def cpu_reference(probes: list[dict]) -> dict[str, float]:
    """Each plan's CPU seconds per optimizer step: the median over its probes of their median.

    One rank on one thread computes without waiting, so on a quiet machine its step time is its CPU
    time, and CPU time is far less disturbed by other work than wall time: the ranking's reference."""
    return {k: statistics.median(statistics.median(p["step_cpu_times"]) for p in probes if p["plan"] == k) for k in {p["plan"] for p in probes}}


def evaluate(policy, probes: list[dict], cpu_ref: dict[str, float]) -> dict:
    """A policy replayed on recorded probes: how far two probes of one plan disagree (every pair,
    |a − b| / min), how many optimizer steps a probe ran after warm-up, whether the plans rank as
    their CPU time does (each two whose CPU times differ by more than :data:`RANK_MARGIN`), and the tilt — the largest ratio between two plans of (step time the
    policy reports / CPU time), minus 1: a statistic that favours one kind of plan shows there."""
    from zeroplan.runtime.measure.steptime import replay

    by_plan: dict[str, list[tuple[float, int]]] = {}
    for p in probes:
        got = replay(policy, p["micro_times"], p["boundary_times"], p["grad_accum"])
        if got is not None:
            by_plan.setdefault(p["plan"], []).append(got)
    diffs = sorted(abs(a - b) / min(a, b) for vals in by_plan.values() for (a, _), (b, _) in itertools.combinations(vals, 2))
    cost = [n for vals in by_plan.values() for _, n in vals]
    step = {k: statistics.median(t for t, _ in vals) for k, vals in by_plan.items()}
    ratio = [step[k] / cpu_ref[k] for k in step]
    return {
        "probes": len(cost), "pairs": len(diffs),
        "median": statistics.median(diffs) if diffs else math.nan,
        "p90": diffs[round(0.9 * (len(diffs) - 1))] if diffs else math.nan,
        "within10": sum(d <= 0.10 for d in diffs) / len(diffs) if diffs else math.nan,
        "steps": statistics.fmean(cost) if cost else math.nan,
        "same_rank": all((step[a] < step[b]) == (cpu_ref[a] < cpu_ref[b]) for a, b in itertools.combinations(step, 2)
                         if max(cpu_ref[a], cpu_ref[b]) / min(cpu_ref[a], cpu_ref[b]) > 1 + RANK_MARGIN),
        "tilt": max(ratio) / min(ratio) - 1 if ratio else math.nan,
    }


def choose(policies, probes: list[dict], cpu_ref: dict[str, float], *, max_cost: float):
    """The policy (after the first, the current one) with the most pairs within 10 %, then the
    smallest 90th-percentile disagreement, then the fewest steps, among those that keep the ranking,
    tilt plans at most 2 points more than the current policy and cost at most ``max_cost`` times its
    steps. Returns (policy, its evaluation) sorted best first."""
    scored = [(pol, evaluate(pol, probes, cpu_ref)) for pol in policies]
    base = scored[0][1]
    fair = [(p, s) for p, s in scored if s["pairs"] and s["same_rank"] and s["tilt"] <= base["tilt"] + 0.02 and s["steps"] <= max_cost * base["steps"]]
    return sorted(fair, key=lambda ps: (-round(ps[1]["within10"], 3), round(ps[1]["p90"], 3), ps[1]["steps"]))


def as_cpu(p: dict) -> dict:
    """The probe with its CPU seconds in place of its wall seconds, micro-step by micro-step.

    One rank on one thread computes without waiting for anything but a core: on a quiet machine
    its wall time is its CPU time, and CPU time keeps what drifts in the plan's own work (caches,
    the frequency, the host under the VM) while leaving out the share of cores other jobs take. On
    a loaded machine these series are the closest to a quiet one's."""
    g, cpu = p["grad_accum"], p["micro_cpu_times"]
    return p | {
        "micro_times": [x for i, x in enumerate(cpu) if (i + 1) % g != 0],
        "boundary_times": [x for i, x in enumerate(cpu) if (i + 1) % g == 0],
    }


def _row(label: str, half: str, s: dict) -> str:
    return (f"{label:<44} {half:<7} {s['pairs']:>5} {s['median']:>7.1%} {s['p90']:>7.1%} {s['within10']:>6.0%} {s['steps']:>6.1f} "
            f"{'same' if s['same_rank'] else 'DIFF':>5} {s['tilt']:>6.1%}")


HEAD = f"{'policy':<44} {'half':<7} {'pairs':>5} {'median':>7} {'p90':>7} {'<=10%':>6} {'steps':>6} {'rank':>5} {'tilt':>6}"


def analyze(args: argparse.Namespace) -> None:
    from zeroplan.runtime.measure.steptime import PROBE_POLICY, MeasurePolicy

    data = json.loads(Path(args.series).read_text())
    probes = [p for p in data["probes"] if p["ok"]]
    cpu_ref = cpu_reference(probes)
    old = MeasurePolicy()  # the policy before this comparison: mean, --ci 0.1, 1-5 steps
    policies = [old] + [MeasurePolicy(statistic=s, target_ci=ci, min_steps=n, max_steps=mx, extra_warmup=w) for s, ci, n, mx, w in CANDIDATES]

    # Warm-up left after the 2 warm-up steps: each measured step against its probe's median, by
    # position (CPU seconds of the step as well: less disturbed by the other work than wall time).
    n = min(len(step_series(p)) for p in probes)
    print("measured step i / its probe's median (median over all probes)")
    print("step  " + " ".join(f"{i + 1:>5}" for i in range(n)))
    for name, series in (("wall", step_series), ("cpu", lambda p: p["step_cpu_times"])):
        rel = [statistics.median(series(p)[i] / statistics.median(series(p)) for p in probes) for i in range(n)]
        print(f"{name:<5} " + " ".join(f"{r:>5.2f}" for r in rel))
    print("\nCPU s per step by plan (the ranking's reference): " + ", ".join(f"{k} {v:.3f}" for k, v in sorted(cpu_ref.items(), key=lambda kv: kv[1])))

    views = {"CPU seconds (a quiet machine's proxy)": [as_cpu(p) for p in probes if p.get("micro_cpu_times")], "wall seconds (as measured)": probes}
    chosen = None
    for view, ps in views.items():
        if not ps:
            continue
        first, second, half = halves(ps)
        loads = {h: [x for p in part for x in p["load_1m"]] for h, part in (("choose", first), ("report", second))}
        print(f"\n== {view}: {len(ps)} probes of {len({p['plan'] for p in ps})} plans; choose on rounds < {half} "
              f"(1-min load {min(loads['choose']):.1f}-{max(loads['choose']):.1f}), report on rounds >= {half} "
              f"(load {min(loads['report']):.1f}-{max(loads['report']):.1f}) on {os.cpu_count()} cores")
        ranked = choose(policies, first, cpu_ref, max_cost=args.max_cost)
        if chosen is None:
            chosen = ranked[0][0] if ranked else None
            print(f"chosen on this view's first half: {chosen.label() if chosen else 'none'}")
        print(HEAD)
        print("-" * len(HEAD))
        shown, seen = [old, PROBE_POLICY, *(p for p, _ in ranked[: args.top])], set()
        for pol in shown:
            if pol in seen:
                continue
            seen.add(pol)
            tag = " (old)" if pol == old else " (PROBE_POLICY)" if pol == PROBE_POLICY else ""
            for h, part in (("choose", first), ("report", second)):
                print(_row(pol.label() + tag, h, evaluate(pol, part, cpu_ref)))
        n_all = min(len(p["boundary_times"]) for p in ps)
        print(f"-- every recorded step ({n_all}) of each probe: the disagreement left by drift between probes")
        for stat in ("mean", "median", "p25"):
            pol = MeasurePolicy(statistic=stat, target_ci=0.0, min_steps=n_all, max_steps=n_all)
            for h, part in (("choose", first), ("report", second)):
                print(_row(f"{stat} of all", h, evaluate(pol, part, cpu_ref)))
    print(f"\nthe runtime's policy (PROBE_POLICY): {PROBE_POLICY.label()}")


#: Seconds of timed steps a probe would wait for before it may stop, compared by ``floors``.
FLOORS = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)


def replay_with_floor(policy, micro_s: list[float], boundary_s: list[float], grad_accum: int, floor_s: float):
    """``replay`` of a probe that also may not stop before its timed micro-steps cover ``floor_s``
    seconds (past the policy's most steps if need be): (step time, measured optimizer steps), or
    None when the series ends first."""
    from zeroplan.runtime.measure.steptime import estimate_step_time, step_statistic, whole_steps

    per = grad_accum - 1
    for k in range(1, len(boundary_s) + 1):
        micro, boundary = micro_s[: k * per], boundary_s[:k]
        if len(micro) < k * per:
            return None
        estimate = estimate_step_time(micro, boundary, grad_accum, policy.statistic)
        if sum(micro) + sum(boundary) >= floor_s and (k >= policy.max_steps or policy.done(estimate, k)):
            return step_statistic(whole_steps(micro, boundary, grad_accum), policy.statistic), k
    return None


def floors(args: argparse.Namespace) -> None:
    """Would a longer timed window make two probes of one plan agree? The probe policy with each
    floor of :data:`FLOORS` (seconds of timed steps before it may stop) replayed on recorded series
    in wall seconds (record them on an idle machine): how far two probes of one plan disagree, per
    half. A floor is picked on the first half — the smallest whose pairs are all within 10 %, else
    the one with the most — and read on the second."""
    from zeroplan.runtime.measure.steptime import PROBE_POLICY

    data = json.loads(Path(args.series).read_text())
    probes = [p for p in data["probes"] if p["ok"]]
    first, second, half = halves(probes)
    loads = [x for p in probes for x in p["load_1m"]]
    steps = [s for p in probes for s in step_series(p)]
    print(f"# {args.series}: {len(probes)} probes of {len({p['plan'] for p in probes})} plans, {min(len(step_series(p)) for p in probes)}+ "
          f"measured steps each (median {statistics.median(steps) * 1e3:.0f} ms); 1-min load {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
    print(f"# the probe policy ({PROBE_POLICY.label()}) held until the floor; choose on rounds < {half}, read on rounds >= {half}; wall seconds")
    print(f"{'floor':>6} {'half':<7} {'pairs':>5} {'median':>7} {'p90':>7} {'max':>7} {'<=10%':>6} {'steps':>6}")
    scored = []
    for floor in FLOORS:
        for name, part in (("choose", first), ("read", second)):
            by_plan: dict[str, list[float]] = {}
            cost = []
            for p in part:
                got = replay_with_floor(PROBE_POLICY, p["micro_times"], p["boundary_times"], p["grad_accum"], floor)
                if got is not None:
                    by_plan.setdefault(p["plan"], []).append(got[0])
                    cost.append(got[1])
            diffs = sorted(abs(a - b) / min(a, b) for vals in by_plan.values() for a, b in itertools.combinations(vals, 2))
            if not diffs:
                print(f"{floor:>6.2f} {name:<7}     0   (the series end before this floor)")
                continue
            within = sum(d <= 0.10 for d in diffs) / len(diffs)
            print(f"{floor:>6.2f} {name:<7} {len(diffs):>5} {statistics.median(diffs):>7.1%} {diffs[round(0.9 * (len(diffs) - 1))]:>7.1%} "
                  f"{diffs[-1]:>7.1%} {within:>6.0%} {statistics.fmean(cost):>6.1f}")
            if name == "choose":
                scored.append((floor, within))
    complete = [f for f, w in scored if w == 1.0]
    pick = min(complete) if complete else max(scored, key=lambda fw: (fw[1], -fw[0]))[0]
    print(f"picked on the first half: {pick:g} s")


def tunes(args: argparse.Namespace) -> None:
    """The done-when of issue 22 as the user meets it: ``--repeat`` times, one ``tune`` of the
    example GPT (1 rank, stage 0, global batch 32, 3 trials: the two best are measured again) and a
    ``probe`` of its best plan right after; prints each plan measured twice in the tune and the
    probe against the tune's figure, with the 1-minute load, and how many pairs are within 10 %."""
    import csv

    tmp = Path(tempfile.mkdtemp(prefix="zeroplan-repeat-tunes-"))
    script = str(ROOT / "examples" / "train_deepspeed.py")
    within, after = [], []
    print(f"{'run':<4} {'plan':<24} {'first':>8} {'again':>8} {'diff':>6}   {'CPU s/step (fastest)':<22} load   (samples/s)", flush=True)
    within_cpu, after_cpu = [], []
    for i in range(1, args.repeat + 1):
        out = tmp / f"tune-{i}"
        load0, t0 = os.getloadavg()[0], time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "zeroplan", "tune", script, "--gpus", "1", "--stage", "0", "--global-batch", "32",
                               "--trials", "3", "--output", str(out), "--", "--steps", "30"], capture_output=True, text=True)
        wall, load1 = time.monotonic() - t0, os.getloadavg()[0]
        if proc.returncode != 0 or not (out / "trials.csv").exists():
            print(f"{i:<4} tune failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
            continue
        rows = [r for r in csv.DictReader((out / "trials.csv").open()) if r["status"] == "ok" and r["measured_samples_per_second"]]
        for r in rows:
            again = [float(x) for x in (r.get("remeasured_samples_per_second") or "").split(";") if x]
            for k, a in enumerate(again, start=2):
                first = float(r["measured_samples_per_second"])
                d = abs(a - first) / min(a, first)
                within.append(d)
                trial = out / "probes" / f"trial-{int(r['trial']):04d}"
                c1, c2 = _fastest_cpu(trial), _fastest_cpu(trial.with_name(f"{trial.name}-run{k}"))
                cpu = f"{c1:.3f} {c2:.3f} {abs(c2 - c1) / min(c1, c2):>5.1%}" if c1 and c2 else "–"
                if c1 and c2:
                    within_cpu.append(abs(c2 - c1) / min(c1, c2))
                print(f"{i:<4} {r['plan']:<24} {first:>8.1f} {a:>8.1f} {d:>6.1%}   {cpu:<22} {load0:.1f}-{load1:.1f}", flush=True)
        best = max(rows, key=lambda r: float(r["ranked_samples_per_second"] or 0))
        micro, accum = best["micro_batch"], best["gradient_accumulation_steps"]
        load2 = os.getloadavg()[0]
        probe = subprocess.run([sys.executable, "-m", "zeroplan", "probe", script, "--gpus", "1", "--stage", "0", "--micro-batch", micro,
                                "--grad-accum", accum, "--format", "json", "--workdir", str(tmp / f"probe-{i}"), "--", "--steps", "30"],
                               capture_output=True, text=True)
        try:
            got = float(json.loads(probe.stdout)["samples_per_second"])
        except (ValueError, KeyError, TypeError):
            print(f"{i:<4} probe of {best['plan']} failed (exit {probe.returncode})")
            continue
        ranked = float(best["ranked_samples_per_second"])
        after.append(got / ranked - 1)
        tune_cpu = [c for c in (_fastest_cpu(t) for t in (out / "probes").glob(f"trial-{int(best['trial']):04d}*")) if c]
        c_probe = _fastest_cpu(tmp / f"probe-{i}")
        cpu = f"{min(tune_cpu):.3f} {c_probe:.3f} {c_probe / min(tune_cpu) - 1:>+5.1%}" if tune_cpu and c_probe else "–"
        if tune_cpu and c_probe:
            after_cpu.append(c_probe / min(tune_cpu) - 1)
        print(f"{i:<4} {best['plan']:<24} {ranked:>8.1f} {got:>8.1f} {got / ranked - 1:>+6.1%}   {cpu:<22} {load2:.1f}-{os.getloadavg()[0]:.1f}"
              f"   (tune's ranked figure, then `probe` right after; tune wall {wall:.0f} s{_core_sharing(proc.stdout)})", flush=True)
    if within:
        print(f"\nwithin a tune: {sum(d <= 0.10 for d in within)} of {len(within)} pairs within 10 % (largest {max(within):.1%})")
    if after:
        print(f"probe right after: {sum(abs(a) <= 0.10 for a in after)} of {len(after)} within 10 % ({', '.join(f'{a:+.1%}' for a in after)})")
    if within_cpu or after_cpu:
        print(f"in CPU seconds per step (the fastest step's; one rank on one thread): within a tune {sum(d <= 0.10 for d in within_cpu)} of "
              f"{len(within_cpu)} pairs within 10 % (largest {max(within_cpu, default=0):.1%}); probe right after "
              f"{', '.join(f'{a:+.1%}' for a in after_cpu)} against the tune's fastest")
    print(f"(load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


def _core_sharing(tune_stdout: str) -> str:
    """The tune's reading of how much of the time the cores ran at reduced speed (its ranking line), or ''."""
    import re

    m = re.search(r"cores ran at reduced speed (\d+)–(\d+)% of the time, ([\d.]+)× slower", " ".join(tune_stdout.split()))
    return f"; cores at reduced speed {m.group(1)}–{m.group(2)} % of the time, {m.group(3)}× slower" if m else ""


def _fastest_cpu(workdir: Path) -> float | None:
    """The fastest measured step's CPU seconds on rank 0 of a probe's workdir (None if not there)."""
    try:
        cpu = json.loads((workdir / "rank-0.json").read_text()).get("step_cpu_times") or []
    except (OSError, ValueError):
        return None
    return min(cpu) if cpu else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("--rounds", type=int, default=8)
    r.add_argument("--steps", type=int, default=24, help="measured optimizer steps per probe (the early stop off)")
    r.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "repeat_series.json"))
    r.add_argument("--append", action="store_true", help="add rounds to an existing file")
    a = sub.add_parser("analyze")
    a.add_argument("series")
    a.add_argument("--top", type=int, default=8)
    a.add_argument("--max-cost", type=float, default=1.6, help="most measured steps per probe, as a multiple of the current policy's")
    f = sub.add_parser("floors")
    f.add_argument("series")
    t = sub.add_parser("tunes")
    t.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    {"record": record, "analyze": analyze, "floors": floors, "tunes": tunes}[args.cmd](args)


if __name__ == "__main__":
    main()
