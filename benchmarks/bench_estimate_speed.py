"""Wall time of `zeroplan estimate --params 175e9 --gpus 64` vs DeepSpeed's estimator functions.

Both run as whole processes (interpreter start and imports included), several times each, in
the same run; the table shows medians and the ratio. Goal: zeroplan at least 6× faster.

    python benchmarks/bench_estimate_speed.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEEPSPEED_SNIPPET = """
import os
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs_all_cold
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
estimate_zero2_model_states_mem_needs_all_cold(total_params=175e9, num_gpus_per_node=8, num_nodes=8)
estimate_zero3_model_states_mem_needs_all_cold(total_params=175e9, largest_layer_params=617558016,
                                               num_gpus_per_node=8, num_nodes=8)
"""


def timed(cmd: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    dt = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    runs = {
        "zeroplan estimate (table, 196 plans)": [sys.executable, "-m", "zeroplan", "estimate", "--params", "175e9", "--gpus", "64", "--cpu-memory", "1024"],
        "zeroplan estimate --format json": [sys.executable, "-m", "zeroplan", "estimate", "--params", "175e9", "--gpus", "64", "--cpu-memory", "1024", "--format", "json"],
        "DeepSpeed estimate_zero2/3_..._all_cold": [sys.executable, "-c", DEEPSPEED_SNIPPET],
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for name, cmd in runs.items():
        timed(cmd)  # warm the file cache
    for _ in range(args.repeats):
        for name, cmd in runs.items():  # interleaved, so machine noise hits both alike
            times[name].append(timed(cmd))

    from rich.console import Console
    from rich.table import Table

    peer = statistics.median(times["DeepSpeed estimate_zero2/3_..._all_cold"])
    table = Table(title=f"175B on 64 GPUs: whole-process wall time, median of {args.repeats} (lower is better)")
    table.add_column("command")
    table.add_column("median s", justify="right")
    table.add_column("min s", justify="right")
    table.add_column("DeepSpeed / this", justify="right")
    for name, ts in times.items():
        med = statistics.median(ts)
        table.add_row(name, f"{med:.3f}", f"{min(ts):.3f}", f"{peer / med:.1f}×")
    Console(width=120).print(table)
    print("DeepSpeed's functions give model states only (no activations, traffic or time); zeroplan covers every plan.")


if __name__ == "__main__":
    main()
