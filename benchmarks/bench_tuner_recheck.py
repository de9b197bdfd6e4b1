"""Re-measure a few plans of the tuner benchmark's space, interleaved, to see how far one probe can be trusted.

Each round probes every given plan once (same probe settings as bench_tuner.py's grid: 2
processes, global batch 8, 2 warm-up + 20 measured steps), so a change of load on a shared
machine hits all plans alike; prints each plan's measurements and their spread.

    PYTHONPATH=. python benchmarks/bench_tuner_recheck.py --rounds 3 z0/ckpt:none/mb4/ga1 z1/ckpt:none/mb4/ga1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from zeroplan.profiles import resolve_cluster  # noqa: E402
from zeroplan.spec import TrainingSpec  # noqa: E402
from zeroplan.tuner import ProbeRunner, tune_space  # noqa: E402
from zeroplan.tuner.checks import task_declaration  # noqa: E402

TASK = ROOT / "examples" / "gpt_task.py"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("plans", nargs="+")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    args = p.parse_args()
    declared = task_declaration(TASK)
    model, seq_len = declared.model_spec, declared.seq_len
    training = TrainingSpec(seq_len=seq_len, global_batch=args.global_batch)
    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu=None, gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    space = tune_space(model, cluster, training, script_kind="task", device="cpu")
    cands = [space.get(k) for k in args.plans]
    missing = [k for k, c in zip(args.plans, cands) if c is None]
    if missing:
        raise SystemExit(f"not in the space: {missing}")
    tmp = Path(tempfile.mkdtemp(prefix="zeroplan-bench-recheck-"))
    runner = ProbeRunner(script=TASK, nproc=2, training=training, model=model, workdir=tmp, steps=20, warmup=2, timeout_s=300)
    values: dict = {k: [] for k in args.plans}
    for r in range(args.rounds):
        for i, cand in enumerate(cands):
            o = runner(cand.plan, trial_number=100 * r + i)
            values[cand.key].append(o.samples_per_second if o.ok else float("nan"))
            print(f"round {r + 1} {cand.key:<32} {o.status} {o.samples_per_second:8.2f} samples/s  (load {os.getloadavg()[0]:.1f})", flush=True)
    print()
    for key, vals in values.items():
        print(f"{key:<32} " + " ".join(f"{v:7.2f}" for v in vals) + f"   median {statistics.median(vals):7.2f}  max/min {max(vals) / max(min(vals), 1e-9):.2f}")
    print(f"(load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
