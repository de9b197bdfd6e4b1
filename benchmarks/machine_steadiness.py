"""How steady is this machine's CPU speed? A fixed piece of pure-Python work timed again and again.

Every timing in benchmarks/results/ compares two measurements taken minutes apart (the same plan
probed twice, zeroplan against DeepSpeed in one run). On a shared virtual machine the speed of a
core can change under a process that runs alone — another tenant on the same physical core, the
host's frequency — and the load average does not show it. This times one fixed workload (a loop
of integer additions in one thread, no allocation, no I/O) in process time, many times over
``--seconds``, with a pause between runs, and prints the spread: the floor under any "the same
thing measured twice agrees within X %" on this machine at this moment.

    python benchmarks/machine_steadiness.py [--seconds 90] [--iterations 3000000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def work(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--iterations", type=int, default=3_000_000)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between runs")
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    times: list[float] = []
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        t = time.process_time()
        work(args.iterations)
        times.append(time.process_time() - t)
        time.sleep(args.pause)
    ordered = sorted(times)
    n = len(ordered)
    med = statistics.median(ordered)
    print(f"{n} runs of a fixed {args.iterations:,}-addition loop over {args.seconds:.0f} s, process time per run "
          f"(load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} cores):")
    print(f"  min {ordered[0]:.3f}  p10 {ordered[n // 10]:.3f}  median {med:.3f}  p90 {ordered[9 * n // 10]:.3f}  "
          f"max {ordered[-1]:.3f} s")
    print(f"  max/min {ordered[-1] / ordered[0]:.2f}; p90/p10 {ordered[9 * n // 10] / ordered[n // 10]:.2f}")
    windows = [statistics.median(times[i:i + 10]) for i in range(0, n - 9, 10)]
    if windows:
        print("  medians of 10 consecutive runs: " + " ".join(f"{w:.3f}" for w in windows)
              + f"  (spread {max(windows) / min(windows) - 1:.0%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
