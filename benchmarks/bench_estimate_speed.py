"""`zeroplan estimate --params 175e9 --gpus 64` vs DeepSpeed's estimator functions, and a sweep.

1. Both run as whole processes (interpreter start and imports included), several times each,
   interleaved in the same run; the table shows the median process time (user + system CPU of
   the child, what machine load inflates least), its spread, the median wall time and the ratio.
   Goal: zeroplan at least 10× faster in process time. The table runs twice: with its output
   piped (as the goal is measured: a file or a program reads it, and it is drawn without rich's
   console, zeroplan/cli/plain_draw.py) and on a pseudo-terminal of 80 columns (in colour, drawn
   by rich), what a user at a terminal waits for.
2. A sweep through the Python API: 7 model sizes (1.3B–530B, shapes derived from the count) ×
   6 clusters (8–4,096 A100-80GB, 8 per node), every plan `zeroplan estimate` enumerates for
   each, estimated and ranked with :func:`zeroplan.estimator.estimate_all`; process time of the
   whole sweep in a fresh process, several runs. Goal: under a second.

    python benchmarks/bench_estimate_speed.py [--repeats 7] [--base PATH]

``--base PATH`` (another checkout, e.g. ``git worktree add /tmp/main main``) runs that tree's
``zeroplan estimate`` too, interleaved with this one's and DeepSpeed's in the same rounds, so a
change is compared with its base at the same machine load (the base's rows are named after its
folder; each row's ratio is to DeepSpeed's functions of the same rounds). The sweep is this tree's.
"""

from __future__ import annotations

import argparse
import os
import resource
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


SWEEP_SNIPPET = """
import time
t0 = time.process_time()
from zeroplan.estimator import enumerate_plans, estimate_all
from zeroplan.profiles import load_gpu
from zeroplan.spec import ClusterSpec, TrainingSpec, derive_shape_from_params
gpu = load_gpu("a100-80gb")
training = TrainingSpec()
plans = 0
t1 = time.process_time()
for params in (1.3e9, 7e9, 13e9, 30e9, 70e9, 175e9, 530e9):
    model = derive_shape_from_params(params)
    for gpus in (8, 32, 128, 512, 1024, 4096):
        cluster = ClusterSpec(gpus=gpus, gpus_per_node=8, gpu=gpu, gpu_memory_bytes=80 * 2**30, cpu_memory_per_node_bytes=1024 * 2**30)
        plans += len(estimate_all(model, cluster, training, enumerate_plans(model, cluster, training)))
print(plans, time.process_time() - t1, t1 - t0)
"""


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], root: Path = ROOT) -> tuple[float, float, str]:
    """(wall s, process CPU s, stdout) of ``cmd`` run as a child process."""
    # Bytecode cached as an installed package has it (pip compiles on install; DeepSpeed's is):
    # a PYTHONDONTWRITEBYTECODE inherited from the shell would make every zeroplan run compile
    # its ~100 modules from source (~0.15 s) and DeepSpeed's not. The warm-up run writes it.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(root)
    cpu0 = _children_cpu_s()
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    dt = time.perf_counter() - t0
    if r.returncode not in (0, 1):
        raise SystemExit(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return dt, _children_cpu_s() - cpu0, r.stdout


def timed_on_terminal(cmd: list[str], root: Path = ROOT) -> tuple[float, float, str]:
    """:func:`timed` with the child's stdout a pseudo-terminal of 80 columns (``TERM=xterm-256color``),
    as a user at a terminal runs it: rich draws the table in colour there, where a pipe gets the
    plain drawing (``zeroplan/cli/plain_draw.py``)."""
    import fcntl
    import pty
    import struct
    import termios

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "COLUMNS", "NO_COLOR")}
    env.update(PYTHONPATH=str(root), TERM="xterm-256color")
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 80, 0, 0))
    cpu0 = _children_cpu_s()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=slave, stderr=subprocess.DEVNULL, env=env, cwd=root)
    os.close(slave)
    chunks = []
    while True:  # drain the terminal as it is written (its buffer is a few KiB)
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    code = proc.wait()
    dt = time.perf_counter() - t0
    os.close(master)
    if code not in (0, 1):
        raise SystemExit(f"command failed ({code}) on a terminal: {' '.join(cmd)}")
    return dt, _children_cpu_s() - cpu0, b"".join(chunks).decode(errors="replace")


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}–{max(values):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--base", type=Path, help="another checkout whose zeroplan estimate runs interleaved with this one's")
    args = ap.parse_args()
    if args.base is not None and not (args.base / "zeroplan" / "cli" / "__init__.py").is_file():
        raise SystemExit(f"--base {args.base}: not a zeroplan checkout (no zeroplan/cli/__init__.py)")
    estimate = [sys.executable, "-m", "zeroplan", "estimate", "--params", "175e9", "--gpus", "64", "--cpu-memory", "1024"]
    trees = [("", ROOT)] + ([(f" ({args.base.name or args.base})", args.base.resolve())] if args.base is not None else [])
    runs: dict[str, tuple[list[str], Path]] = {}
    on_terminal: set[str] = set()
    for suffix, root in trees:
        runs[f"zeroplan estimate (table, 196 plans, piped){suffix}"] = (estimate, root)
        runs[f"zeroplan estimate (table, terminal){suffix}"] = (estimate, root)
        on_terminal.add(f"zeroplan estimate (table, terminal){suffix}")
        runs[f"zeroplan estimate --format json{suffix}"] = (estimate + ["--format", "json"], root)
    runs["DeepSpeed estimate_zero2/3_..._all_cold"] = ([sys.executable, "-c", DEEPSPEED_SNIPPET], ROOT)
    load_before = os.getloadavg()
    walls: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    for name, (cmd, root) in runs.items():
        (timed_on_terminal if name in on_terminal else timed)(cmd, root)  # warm the file cache (and write each tree's bytecode)
    for _ in range(args.repeats):
        for name, (cmd, root) in runs.items():  # interleaved, so machine noise hits both alike
            wall, cpu, _ = (timed_on_terminal if name in on_terminal else timed)(cmd, root)
            walls[name].append(wall)
            cpus[name].append(cpu)
    sweep_runs: list[tuple[int, float, float]] = []
    for _ in range(args.repeats):
        _, _, out = timed([sys.executable, "-c", SWEEP_SNIPPET])
        plans, sweep_s, import_s = out.split()
        sweep_runs.append((int(plans), float(sweep_s), float(import_s)))
    load_after = os.getloadavg()

    from rich.console import Console
    from rich.table import Table

    peer = statistics.median(cpus["DeepSpeed estimate_zero2/3_..._all_cold"])
    table = Table(title=f"175B on 64 GPUs: whole process, median of {args.repeats} (lower is better)")
    table.add_column("command", no_wrap=True)
    table.add_column("process s", justify="right")
    table.add_column("min–max", justify="right")
    table.add_column("wall s", justify="right")
    table.add_column("DeepSpeed / this (process)", justify="right")
    for name in runs:
        med = statistics.median(cpus[name])
        table.add_row(name, f"{med:.3f}", spread(cpus[name]), f"{statistics.median(walls[name]):.3f}", f"{peer / med:.1f}×")
    console = Console(width=130)
    console.print(table)
    print("DeepSpeed's functions give model states only (no activations, traffic or time); zeroplan covers every plan.")
    sweep = [s for _, s, _ in sweep_runs]
    print(
        f"\nSweep, 7 model sizes × 6 clusters (8–4,096 GPUs), {sweep_runs[0][0]} plans estimated and ranked through the Python API: "
        f"median {statistics.median(sweep):.3f} s process time (min–max {spread(sweep)}, {len(sweep)} runs; "
        f"imports before it {statistics.median(i for _, _, i in sweep_runs):.3f} s, not counted)."
    )
    print(f"Load average (1/5/15 min) before: {' '.join(f'{x:.2f}' for x in load_before)}; after: {' '.join(f'{x:.2f}' for x in load_after)}; "
          f"{os.cpu_count()} CPUs.")


if __name__ == "__main__":
    main()
