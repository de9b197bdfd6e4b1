"""Pure bf16 (``--precision bf16-pure``) against mixed bf16 under PyTorch's engines: probes of the
example GPT (full fine-tune) and of the small Llama with LoRA adapters, on 1 and 2 processes.

    PYTHONPATH=. python benchmarks/bench_pure_bf16.py [-o benchmarks/results/pure_bf16.txt]

bf16-pure casts the model with ``.to(torch.bfloat16)`` and trains it with torch's AdamW, no
MixedPrecisionPolicy and no autocast: weights, gradients and AdamW's moments all bf16 (torchtune's
``dtype: bf16``). One process at stages 0-1 trains the bare module (no DDP reducer buckets).
Per run: the measured peak (live tensor storage per rank on CPU, ``max_memory_allocated`` on
CUDA), the estimate ``engine="fsdp"`` gives for it, and (est - meas) / meas.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

GPT_ARGS = ("--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "8192", "--seq-len", "128")
LORA_ARGS = ("--layers", "4", "--hidden", "256", "--vocab", "8192", "--seq-len", "128", "--rank", "8", "--targets", "q_proj,v_proj")

#: (label, script, script args, processes, plan keywords, precision)
RUNS = [
    ("gpt 1 proc s0", "gpt_task.py", GPT_ARGS, 1, dict(stage=0), "bf16"),
    ("gpt 1 proc s0", "gpt_task.py", GPT_ARGS, 1, dict(stage=0), "bf16-pure"),
    ("gpt 1 proc s0", "gpt_task.py", GPT_ARGS, 1, dict(stage=0), "fp32"),
    ("gpt 1 proc s0 ga2", "gpt_task.py", GPT_ARGS, 1, dict(stage=0, gradient_accumulation_steps=2), "bf16-pure"),
    ("gpt 2 proc s0 (DDP)", "gpt_task.py", GPT_ARGS, 2, dict(stage=0), "bf16-pure"),
    ("gpt 2 proc s1 (ZeRO-opt)", "gpt_task.py", GPT_ARGS, 2, dict(stage=1), "bf16-pure"),
    ("gpt 2 proc s2 (FSDP2)", "gpt_task.py", GPT_ARGS, 2, dict(stage=2), "bf16-pure"),
    ("gpt 2 proc s3 (FSDP2)", "gpt_task.py", GPT_ARGS, 2, dict(stage=3), "bf16"),
    ("gpt 2 proc s3 (FSDP2)", "gpt_task.py", GPT_ARGS, 2, dict(stage=3), "bf16-pure"),
    ("gpt 2 proc s3 full ckpt", "gpt_task.py", GPT_ARGS, 2, dict(stage=3, checkpointing="full"), "bf16-pure"),
    ("gpt 2 proc s3 ga2", "gpt_task.py", GPT_ARGS, 2, dict(stage=3, gradient_accumulation_steps=2), "bf16-pure"),
    ("lora r8 q,v 1 proc s0", "lora_task.py", LORA_ARGS, 1, dict(stage=0), "bf16"),
    ("lora r8 q,v 1 proc s0", "lora_task.py", LORA_ARGS, 1, dict(stage=0), "bf16-pure"),
    ("lora r8 q,v 2 proc s3", "lora_task.py", LORA_ARGS, 2, dict(stage=3), "bf16-pure"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from zeroplan import profiles
    from zeroplan.estimator import estimate_plan
    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.runtime.probe import comparable_estimate
    from zeroplan.runtime.rank.task import load_task
    from zeroplan.spec import ClusterSpec, Plan, TrainingSpec

    gpu = profiles.default_gpu()[0]
    table = Table(title=f"bf16-pure vs mixed bf16 under PyTorch's engines, micro-batch {args.micro_batch}, torch AdamW; "
                        "bytes per rank", title_justify="left")
    for col in ("run", "precision", "Ψ", "measured peak", "estimate", "error", "peak phase"):
        table.add_column(col, justify="left" if col in ("run", "precision", "peak phase") else "right")
    kind = None
    errors = []
    for label, script, script_args, nproc, kwargs, precision in RUNS:
        path = ROOT / "examples" / script
        task = load_task(path, script_args)
        model = task.model_spec
        training = TrainingSpec(precision=precision, seq_len=128, loss=task.loss or "hf")
        plan = Plan(micro_batch=args.micro_batch, **kwargs)
        r = run_probe(ProbeRequest(script=path, nproc=nproc, backend="fsdp", plan=plan, training=training,
                                   script_args=script_args, steps=2, warmup=2, timeout_s=300))
        if r.status != "ok":
            table.add_row(label, precision, f"{model.params:,}", r.status, "", "", (r.error or "")[:50])
            continue
        kind = r.memory_kind
        on_cpu = kind != "cuda"
        cluster = ClusterSpec(gpus=nproc, gpus_per_node=nproc, gpu=gpu)
        est = estimate_plan(model, cluster, training, plan, device="cpu" if on_cpu else "cuda", engine="fsdp")
        estimated = comparable_estimate(est, on_cpu=on_cpu, ranks_per_node=nproc)
        meas = max(r.peak_memory_per_rank)
        errors.append(abs(estimated - meas) / meas)
        table.add_row(label, precision, f"{model.params:,}", f"{meas:,}", f"{estimated:,}", f"{(estimated - meas) / meas:+.1%}",
                      est.notes[-1].split(" (")[0].replace("peak at ", ""))
    out = Console(file=args.output.open("w") if args.output else None, width=160)
    out.print(table)
    out.print(f"measured: {'live tensor storage per rank (CPU run, gloo)' if kind != 'cuda' else 'torch.cuda.max_memory_allocated'}; "
              f"max |error| {max(errors):.1%} over {len(errors)} runs" if errors else "no run finished")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
