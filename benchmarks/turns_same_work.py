"""Is a slow measurement the process's or the moment's? Three processes run the same training step
(two small transformer layers and AdamW, one thread, pinned to one core) and take turns, each
timing its steps for ``--window`` seconds before handing the core to the next.

A probe is a fresh process, and two probes of one plan are compared minutes apart: if a process
carried its own speed (where its memory landed, its allocator's state), the three would keep their
order round after round; if the machine's speed moves (another tenant on the same physical core,
the host taking the virtual CPU away — neither shows in the load average or in /proc/stat's steal
time here), the three move together and a slow reading lasts as long as the moment, whoever runs.
Prints each round's fastest step per process and how often a round's processes disagree.

    python benchmarks/turns_same_work.py [--rounds 10] [--window 1.5] [--core 0]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

NAMES = "ABC"


def _turns(name: str, mine, after, out, done, rounds: int, window: float, core: int) -> None:
    import torch

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(128, 4, 256, batch_first=True) for _ in range(2)])
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(16, 64, 128)
    rows = []
    for _ in range(rounds):
        mine.acquire()
        steps = []
        end = time.perf_counter() + window
        while time.perf_counter() < end:
            t = time.perf_counter()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            steps.append(time.perf_counter() - t)
        timed = steps[2:] or steps  # the first two steps of a turn wake caches
        rows.append((min(timed), statistics.median(timed), time.time()))
        after.release()
    out.put((name, rows))
    done.wait()  # none exits (its teardown on this core) while another still times its turn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--window", type=float, default=1.5, help="seconds each process times per turn")
    ap.add_argument("--core", type=int, default=0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    turn = [ctx.Semaphore(0) for _ in NAMES]
    out, done = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_turns, args=(n, turn[i], turn[(i + 1) % len(NAMES)], out, done, args.rounds, args.window, args.core))
             for i, n in enumerate(NAMES)]
    for p in procs:
        p.start()
    time.sleep(8)  # every process has imported torch and built its model
    load = os.getloadavg()[0]
    turn[0].release()
    got = dict(out.get() for _ in procs)
    done.set()
    for p in procs:
        p.join()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, 1-min load {load:.1f}-{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"core {args.core}, {args.window:g} s per turn")
    print(f"{'round':<6}" + "".join(f"{'fastest ' + n + ' ms':>14}" for n in NAMES) + f"{'spread':>9}")
    apart = 0
    for r in range(args.rounds):
        mins = [got[n][r][0] * 1e3 for n in NAMES]
        spread = max(mins) / min(mins) - 1
        apart += spread > 0.10
        print(f"{r + 1:<6}" + "".join(f"{m:>14.1f}" for m in mins) + f"{spread:>9.1%}")
    firsts = {n: sum(got[n][r][0] == min(got[m][r][0] for m in NAMES) for r in range(args.rounds)) for n in NAMES}
    every = [got[n][r][0] for n in NAMES for r in range(args.rounds)]
    print(f"rounds whose processes differ by more than 10 %: {apart} of {args.rounds}; fastest of its round: "
          + ", ".join(f"{n} {k}x" for n, k in firsts.items()))
    print(f"fastest step over all turns {min(every) * 1e3:.1f} ms, slowest turn's fastest {max(every) * 1e3:.1f} ms "
          f"({max(every) / min(every) - 1:.0%} apart)")


if __name__ == "__main__":
    main()
