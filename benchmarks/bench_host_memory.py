"""Host memory per node: the estimator's phases against probes measured on this machine.

    PYTHONPATH=. python benchmarks/bench_host_memory.py [-o benchmarks/results/host_memory.txt]
    PYTHONPATH=. python benchmarks/bench_host_memory.py --nproc 4 --layers 2 --hidden 256 --vocab 8192 \
        -o benchmarks/results/host_memory_4ranks.txt

DeepSpeed on 2 (``--nproc``) CPU ranks (gloo) runs ``benchmarks/host_memory_script.py`` (the GPT of
examples/gpt_task.py, built plainly or under ``deepspeed.zero.Init``) for each case: ZeRO-2 and
ZeRO-3 with ``offload_optimizer: cpu``, ZeRO-3 with ``offload_param: cpu``, ``pin_memory`` on and
off, ``zero.Init`` on and off. Per case and phase it prints the node's measured peak RSS (sampled
from the launcher, shared pages once) beside the estimate (the estimator's phases plus the node's
measured idle footprint), the error, and the worst phase each names.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {
    "z2 opt:cpu pin": dict(stage=2, offload_optimizer="cpu", pin=True, zero_init=False),
    "z2 opt:cpu nopin": dict(stage=2, offload_optimizer="cpu", pin=False, zero_init=False),
    "z3 opt:cpu": dict(stage=3, offload_optimizer="cpu", pin=True, zero_init=False),
    "z3 opt:cpu zero.Init": dict(stage=3, offload_optimizer="cpu", pin=True, zero_init=True),
    "z3 opt+param:cpu": dict(stage=3, offload_optimizer="cpu", offload_param="cpu", pin=True, zero_init=False),
    "z3 opt+param:cpu nopin": dict(stage=3, offload_optimizer="cpu", offload_param="cpu", pin=False, zero_init=False),
    "z3 opt+param:cpu zero.Init": dict(stage=3, offload_optimizer="cpu", offload_param="cpu", pin=True, zero_init=True),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--nproc", type=int, default=2, help="ranks on this node")
    p.add_argument("-o", "--output", type=Path)
    args = p.parse_args(argv)

    sys.path.insert(0, str(ROOT / "examples"))
    import gpt_task

    from zeroplan.dsconfig import build_config
    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.spec import Plan, TrainingSpec

    cfg = gpt_task.GPTConfig(layers=args.layers, hidden=args.hidden, heads=8, vocab=args.vocab, seq_len=64)
    model = gpt_task.model_spec(cfg)
    training = TrainingSpec(precision="bf16", seq_len=64)
    rows = []
    for name in [c.strip() for c in args.cases.split(",") if c.strip()]:
        case = dict(CASES[name])
        pin, zero_init = case.pop("pin"), case.pop("zero_init")
        plan = Plan(micro_batch=2, **case)
        ds = build_config(plan, world_size=args.nproc, training=training, model=model)
        for key in ("offload_optimizer", "offload_param"):
            block = ds["zero_optimization"].get(key)
            if isinstance(block, dict) and block.get("device") == "cpu":
                block["pin_memory"] = pin
        script_args = ("--layers", str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab))
        script_args += ("--zero-init",) if zero_init else ()
        r = run_probe(ProbeRequest(script=ROOT / "benchmarks" / "host_memory_script.py", nproc=args.nproc, ds_config=ds, model=model,
                                   training=training, script_args=script_args, steps=2, warmup=1, timeout_s=900))
        rows.append({"case": name, "status": r.status, "error": r.error, **{k: v for k, v in r.as_dict().items() if k.startswith(("host", "estimated_host"))}})
        print(f"{name}: {r.status} measured {r.host_peak_per_node} estimated {r.estimated_host_peak_per_node}", file=sys.stderr)

    mib = lambda n: "—" if n is None else f"{n / 2**20:,.0f}"  # noqa: E731
    lines = [
        f"DeepSpeed 0.19 on {args.nproc} CPU ranks (gloo, this machine, shared with other jobs): GPT L{args.layers} h{args.hidden} "
        f"V{args.vocab} (Ψ = {model.params:,}), bf16, micro-batch 2. Host RSS per node in MiB (torchrun + {args.nproc} workers,",
        f"shared pages once); estimate = the estimator's phases + the node's measured idle footprint (baseline).",
        "",
        f"{'case':28} {'phase':12} {'measured':>9} {'estimate':>9} {'error':>7}",
    ]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"{row['case']:28} {row['status']}: {row['error']}")
            continue
        for phase, measured in row["host_phase_peaks_per_node"].items():
            est = row["estimated_host_phases_per_node"].get(phase)
            err = f"{(est - measured) / measured:+.0%}" if est else "—"
            lines.append(f"{row['case']:28} {phase:12} {mib(measured):>9} {mib(est):>9} {err:>7}")
        err = row["host_memory_error"]
        lines.append(
            f"{row['case']:28} {'PEAK':12} {mib(row['host_peak_per_node']):>9} {mib(row['estimated_host_peak_per_node']):>9} "
            f"{err:+.0%}   worst phase measured {row['host_worst_phase']}, estimated {row['estimated_host_worst_phase']}; "
            f"baseline {mib(row['host_baseline_per_node'])}"
        )
    text = "\n".join(lines) + "\n"
    if args.output:
        args.output.write_text(text)
        args.output.with_suffix(".json").write_text(json.dumps({"model": model.as_dict(), "rows": rows}, indent=2) + "\n")
    print(text)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
