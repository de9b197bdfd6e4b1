"""How steady is this machine's CPU speed? A fixed piece of pure-Python work timed again and again.

Every timing in benchmarks/results/ compares two measurements taken minutes apart (the same plan
probed twice, zeroplan against DeepSpeed in one run). On a shared virtual machine the speed of a
core can change under a process that runs alone — another tenant on the same physical core, the
host's frequency — and the load average does not show it. This times one fixed workload (a loop
of integer additions in one thread, no allocation, no I/O) in process time, many times over
``--seconds``, with a pause between runs, and prints the spread: the floor under any "the same
thing measured twice agrees within X %" on this machine at this moment.

Beside it, the share of time each core ran at reduced speed (:mod:`zeroplan.tuner.coreshare`, the
figure ``zeroplan tune`` reports): a reading of every core before the runs, after every 10 runs and
at the end, and, as a check that time the thread spent preempted is kept out of that share, the
disturbed seconds of each reading against the time the kernel says the thread waited to run
(``run_delay`` in ``/proc/thread-self/schedstat``). ``--competitor`` adds one reading with a busy
process pinned to the first core (Linux time-slicing: its time must show as disturbed, not shared),
and readings of the first core with the second idle and busy in turn (were they two hyperthreads
of one physical core, the busy one would raise the other's shared time: the sharing would be this
machine's own work, not another tenant's).
``--record PATH`` saves one core's chunk series (the tests' fixture, tests/data/coreshare_chunks.json.gz).

    python benchmarks/machine_steadiness.py [--seconds 90] [--iterations 3000000] [--competitor] [--record PATH]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time

from zeroplan.tuner.coreshare import LOOP_ITERATIONS, CoreWatch, alone_cache_path, classify_chunks, measure_cores, pinned_chunks, run_delay_ns, time_chunks


def work(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i
    return total


def checked_reading(watch: CoreWatch, label: str) -> str:
    """One core reading, with each core's disturbed seconds against its thread's run-queue wait."""
    before = run_delay_ns()
    reading = watch.read(label)
    waited = run_delay_ns()
    if reading is None:
        return f"  {label}: not measured"
    line = f"  {label}: {reading.text}"
    disturbed = sum(c.breakdown.disturbed_s for c in reading.cores)
    if before is not None and waited is not None:
        line += f"; disturbed {disturbed * 1e3:.1f} ms vs waited to run {(waited - before) / 1e6:.1f} ms"
    return line


def competitor_reading(core: int, seconds: float = 0.5) -> str:
    """The loop on ``core`` while a busy process is pinned to the same core."""
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        time.sleep(0.1)
        durations, waited = pinned_chunks(core, seconds)
    finally:
        busy.kill()
        busy.wait()
    b = classify_chunks(durations)
    wait_ms = waited / 1e6 if waited is not None else float("nan")
    return (f"  busy process pinned to core {core} beside the loop ({seconds} s): shared {b.shared_fraction:.0%}, "
            f"disturbed {b.disturbed_s * 1e3:.0f} ms in {b.disturbed_chunks} chunks vs waited to run {wait_ms:.0f} ms")


def neighbour_check(core: int, other: int, rounds: int = 6, seconds: float = 0.25) -> str:
    """The loop on ``core`` with and without a busy process on ``other``, alternately: were this
    machine's two cores hyperthreads of one physical core, the busy one would slow the other."""
    fractions: dict[bool, list[float]] = {False: [], True: []}
    before_affinity = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {core})
        for _ in range(rounds):
            for busy_other in (False, True):
                busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{other}}})\nwhile True: pass"]) \
                    if busy_other else None
                try:
                    time.sleep(0.1)
                    fractions[busy_other].append(classify_chunks(time_chunks(seconds)).shared_fraction)
                finally:
                    if busy is not None:
                        busy.kill()
                        busy.wait()
    finally:
        os.sched_setaffinity(0, before_affinity)
    return (f"  core {core} with core {other} idle: shared {' '.join(f'{f:.0%}' for f in fractions[False])} (mean "
            f"{statistics.mean(fractions[False]):.0%}); with a busy process on core {other}: "
            f"{' '.join(f'{f:.0%}' for f in fractions[True])} (mean {statistics.mean(fractions[True]):.0%})")


def record(path: str, core: int, seconds: float) -> None:
    """Save one core's chunk series with what the kernel says about the thread meanwhile."""
    durations, waited = pinned_chunks(core, seconds)
    doc = {
        "how": f"benchmarks/machine_steadiness.py --record: zeroplan.tuner.coreshare.time_chunks({seconds}) pinned to core {core}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_1m": round(os.getloadavg()[0], 2),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "loop_iterations": LOOP_ITERATIONS,
        "run_delay_ns": waited,
        "durations_ns": durations,
    }
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)
    b = classify_chunks(durations)
    print(f"recorded {len(durations)} chunks on core {core} into {path}: shared {b.shared_fraction:.1%}, "
          f"disturbed {b.disturbed_s * 1e3:.1f} ms, waited to run {(doc['run_delay_ns'] or 0) / 1e6:.1f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=90.0)
    ap.add_argument("--iterations", type=int, default=3_000_000)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between runs")
    ap.add_argument("--competitor", action="store_true", help="one reading with a busy process pinned to the first core")
    ap.add_argument("--record", metavar="PATH", help="save one core's chunk series (gzipped JSON) and stop")
    ap.add_argument("--record-seconds", type=float, default=0.1)
    ap.add_argument("--record-core", type=int, default=0)
    args = ap.parse_args()
    if args.record:
        record(args.record, args.record_core, args.record_seconds)
        return 0
    load_start = os.getloadavg()[0]
    watch = CoreWatch(measure_cores, cache=alone_cache_path())
    readings = [checked_reading(watch, "before the runs")]
    times: list[float] = []
    start = time.monotonic()
    while time.monotonic() - start < args.seconds:
        t = time.process_time()
        work(args.iterations)
        times.append(time.process_time() - t)
        if len(times) % 10 == 0:
            readings.append(checked_reading(watch, f"after run {len(times)}"))
        time.sleep(args.pause)
    readings.append(checked_reading(watch, "at the end"))
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
    print(f"time each core ran at reduced speed (shared with work outside this machine), {LOOP_ITERATIONS}-iteration loop, "
          "0.25 s per core:")
    print("\n".join(readings))
    if args.competitor:
        cores = sorted(os.sched_getaffinity(0))
        print(competitor_reading(cores[0]))
        if len(cores) > 1:
            print(neighbour_check(cores[0], cores[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
