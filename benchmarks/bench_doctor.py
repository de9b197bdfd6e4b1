"""How often `zeroplan doctor` names the right class (and, for memory failures, phase) on real logs.

Two sets, split by when they were gathered: the tuning set (tests/data/doctor/*.log), which the
rules were written against, and the held-out set (tests/data/doctor/heldout/), copied from other
public issues after the rules were written and not used to change them. Each log's expected class
and phase are what a reader of its thread gives it (the sidecar JSON). Also times a diagnosis.

    python benchmarks/bench_doctor.py [--out benchmarks/results/doctor.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zeroplan.doctor import DoctorInputs, diagnose, read_logs  # noqa: E402

DATA = ROOT / "tests" / "data" / "doctor"


def score(paths: list[Path]) -> dict:
    rows = []
    for path in paths:
        meta = json.loads(path.with_suffix(".json").read_text())
        d = diagnose(read_logs([str(path)]), DoctorInputs(config=meta.get("config")))  # the run's config, when the thread gives it
        rows.append({"log": path.stem, "source": meta["source"], "expected": meta["class"], "got": d.failure_class,
                     "expected_phase": meta.get("phase"), "got_phase": d.phase})
    memory = [r for r in rows if r["expected_phase"] is not None]
    return {
        "logs": len(rows),
        "class_right": sum(r["expected"] == r["got"] for r in rows),
        "memory_logs_with_phase": len(memory),
        "phase_right": sum(r["expected_phase"] == r["got_phase"] for r in memory),
        "misses": [r for r in rows if r["expected"] != r["got"] or (r["expected_phase"] is not None and r["expected_phase"] != r["got_phase"])],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "doctor.json")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sets = {"tuning": sorted(DATA.glob("*.log")), "held-out": sorted((DATA / "heldout").glob("*.log"))}
    results = {name: score(paths) for name, paths in sets.items()}
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for path in sets["tuning"] + sets["held-out"]:
            diagnose(read_logs([str(path)]))
        times.append((time.perf_counter() - t0) / (len(sets["tuning"]) + len(sets["held-out"])))
    print(f"{'set':<10} {'logs':>5} {'class right':>12} {'memory logs':>12} {'phase right':>12}")
    for name, r in results.items():
        print(f"{name:<10} {r['logs']:>5} {r['class_right']:>12} {r['memory_logs_with_phase']:>12} {r['phase_right']:>12}")
    for name, r in results.items():
        for miss in r["misses"]:
            print(f"  {name} miss: {miss['log']}: got {miss['got']}/{miss['got_phase']}, expected {miss['expected']}/{miss['expected_phase']}")
    print(f"seconds per diagnosis: median {statistics.median(times):.4f}, spread {min(times):.4f}-{max(times):.4f} over {args.repeats} runs")
    doc = {"date": date.today().isoformat(), "load_average": os.getloadavg(), "cpus": os.cpu_count(), "sets": results,
           "seconds_per_diagnosis": {"median": statistics.median(times), "min": min(times), "max": max(times), "runs": args.repeats}}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
