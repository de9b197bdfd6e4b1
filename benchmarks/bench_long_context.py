"""How fast `zeroplan estimate` answers long-context questions, and what it answers.

Each command runs as a whole process (interpreter start and imports included) several times; the
table shows the median process time (user + system CPU of the child, what machine load inflates
least), its range, the median wall time, and the recommended plan with its GPU figure.
Goal (issue 24): the 131,072-token Llama-3-8B question on 8 H100 answered in under a second with
a sequence-parallel plan that fits.

    python benchmarks/bench_long_context.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "llama-3-8b, 8 H100, 131072 tokens (no --sp: widened)": ["--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "131072"],
    "llama-3-8b, 8 H100, 1048576 tokens, --sp auto --loss tiled --tiled-mlp": [
        "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "1048576", "--sp", "auto", "--loss", "tiled", "--tiled-mlp"],
    "llama-3-8b, 32 H100, 15.5M, --sp 32, ALST but no ckpt offload (no flag)": [
        "--model", "llama-3-8b", "--gpus", "32", "--gpu", "h100-80gb", "--seq-len", "15500000", "--sp", "32", "--loss", "fused", "--tiled-mlp",
        "--checkpointing", "full", "--stage", "3", "--offload-optimizer", "cpu", "--offload-param", "none"],
    "llama-3-8b, 8 H100, 8192 tokens, --sp 1,2 --tp 1,2": [
        "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--seq-len", "8192", "--sp", "1,2", "--tp", "1,2"],
}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run(args: list[str]) -> tuple[float, float, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before, start = _children_cpu_s(), time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "zeroplan", "estimate", *args, "--format", "json"], capture_output=True, text=True, env=env, cwd=ROOT)
    wall, cpu = time.perf_counter() - start, _children_cpu_s() - before
    return cpu, wall, json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    opts = parser.parse_args()
    print(f"# {time.strftime('%Y-%m-%dT%H:%MZ', time.gmtime())}, load {' '.join(open('/proc/loadavg').read().split()[:3])}, "
          f"{os.cpu_count()} CPUs, {opts.repeats} runs each")
    print(f"{'question':<72} {'plans':>5} {'CPU s (min-max)':>18} {'wall s':>7}  best plan, GPU GiB")
    for name, args in COMMANDS.items():
        cpus, walls, doc = [], [], {}
        for _ in range(opts.repeats):
            cpu, wall, doc = run(args)
            cpus.append(cpu)
            walls.append(wall)
        best = doc["plans"][0]
        label = f"{best['verdict']} {best['layout']} {best['stage']}/{best['checkpointing']}/mb{best['micro_batch']}: {best['gpu']['required'] / 2**30:.1f}"
        print(f"{name:<72} {len(doc['plans']):>5} {statistics.median(cpus):>6.2f} ({min(cpus):.2f}-{max(cpus):.2f}) "
              f"{statistics.median(walls):>7.2f}  {label}")


if __name__ == "__main__":
    main()
