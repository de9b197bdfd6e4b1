"""Accuracy of the PyTorch-engine memory model (``--engine fsdp``) against probes: the example GPT
under DDP (stage 0), ZeroRedundancyOptimizer (1), FSDP2 (2, 3), CPU offload and full
checkpointing, 2 processes.

    PYTHONPATH=. python benchmarks/bench_fsdp_memory.py [-o benchmarks/results/fsdp_memory.txt]

Per plan: the measured peak (live tensor storage per rank on CPU, ``max_memory_allocated`` on
CUDA), the estimate with ``engine="deepspeed"`` (what zeroplan predicted for these runs before it
modelled PyTorch's engines) and with ``engine="fsdp"``, and their errors (est − meas) / meas.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

PLANS = {
    "ddp (s0)": dict(stage=0),
    "zero-opt (s1)": dict(stage=1),
    "fsdp2 s2": dict(stage=2),
    "fsdp2 s3": dict(stage=3),
    "fsdp2 s2+offload": dict(stage=2, offload_optimizer="cpu"),
    "fsdp2 s3+offload": dict(stage=3, offload_optimizer="cpu", offload_param="cpu"),
    "fsdp2 s2+full": dict(stage=2, checkpointing="full"),
    "fsdp2 s3+full": dict(stage=3, checkpointing="full"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    import gpt_task
    from zeroplan import profiles
    from zeroplan.estimator import estimate_plan
    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.runtime.probe import comparable_estimate
    from zeroplan.spec import ClusterSpec, Plan, TrainingSpec

    from zeroplan.runtime.rank.task import load_task

    cfg = gpt_task.GPTConfig(layers=4, hidden=256, heads=4, vocab=8192, seq_len=128)
    script_args = ("--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "8192", "--seq-len", "128")
    # The task's own model spec (no dropout) and loss (its loop drops the logits: plain), as the
    # probe's own estimate uses them.
    task = load_task(ROOT / "examples" / "gpt_task.py", script_args)
    model = task.model_spec
    training = TrainingSpec(seq_len=cfg.seq_len, loss=task.loss or "hf")
    cluster = ClusterSpec(gpus=2, gpus_per_node=2, gpu=profiles.default_gpu()[0])
    table = Table(title=f"PyTorch engines on 2 ranks: GPT L4 h256 V8192 s128 (Ψ = {model.params:,}), micro-batch "
                        f"{args.micro_batch}, bf16, AdamW; bytes per rank", title_justify="left")
    for col in ("plan", "measured peak", "est deepspeed", "err", "est fsdp", "err", "fsdp peak phase"):
        table.add_column(col, justify="left" if col in ("plan", "fsdp peak phase") else "right")
    kind = None
    for name, kwargs in PLANS.items():
        plan = Plan(micro_batch=args.micro_batch, **kwargs)
        r = run_probe(ProbeRequest(script=ROOT / "examples" / "gpt_task.py", nproc=2, backend="fsdp", plan=plan,
                                   training=training, script_args=script_args, steps=2, warmup=2, timeout_s=300))
        if r.status != "ok":
            table.add_row(name, r.status, "", "", "", "", (r.error or "")[:40])
            continue
        kind = r.memory_kind
        on_cpu = kind != "cuda"
        device = "cpu" if on_cpu else "cuda"
        meas = max(r.peak_memory_per_rank)
        try:
            ds = comparable_estimate(estimate_plan(model, cluster, training, plan, device=device), on_cpu=on_cpu, ranks_per_node=2)
        except Exception:  # noqa: BLE001 - a plan DeepSpeed's model rejects is shown as such
            ds = None
        fs_est = estimate_plan(model, cluster, training, plan, device=device, engine="fsdp")
        fs = comparable_estimate(fs_est, on_cpu=on_cpu, ranks_per_node=2)
        table.add_row(name, f"{meas:,}", f"{ds:,}" if ds else "—", f"{(ds - meas) / meas:+.1%}" if ds else "",
                      f"{fs:,}", f"{(fs - meas) / meas:+.1%}", fs_est.notes[-1].split(" (")[0].replace("peak at ", ""))
    out = Console(file=args.output.open("w") if args.output else None, width=150)
    out.print(table)
    out.print(f"measured: {'live tensor storage per rank (CPU run, gloo)' if kind != 'cuda' else 'torch.cuda.max_memory_allocated'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
