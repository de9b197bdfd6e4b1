"""Post-training recipes on the real engine: SFT vs DPO on the same data and micro-batch, and GRPO,
measured per rank beside the estimator's figures.

    PYTHONPATH=. python benchmarks/bench_recipe_memory.py --repeats 2 -o benchmarks/results/recipe_memory.txt

TRL's own scripts (examples/train_trl_sft.py, train_trl_dpo.py, train_trl_grpo.py: the tiny Llama
of examples/tiny_llama.json) under ``zeroplan probe`` on 2 CPU ranks (gloo), ZeRO-2 and ZeRO-3,
micro-batch 2, TRL's defaults otherwise (bf16, gradient checkpointing, DPO beta 0.1). DPO's
prompts and answers have ``--prompt-len`` and ``--completion-len`` tokens; the SFT row trains
on sequences of the same length (prompt + answer + EOS). GRPO generates ``--generations``
completions of ``--grpo-completion-len`` tokens per prompt with HF ``generate`` and keeps a
reference model (``--beta 0.04``).

Per row: the largest per-rank peak (live tensor storage; median and spread over the repeats),
the estimate the probe printed beside it (the recipe's where the estimator models recipes, else
supervised fine-tuning's, which the note column says), and for GRPO the memory phases the probe
itemised (GRPO: generation, scoring = no-grad log-prob passes, rollout; every TRL trainer: loss
forward, which for DPO holds the policy's concatenated pass and the reference forward, and backward). The summary
compares what the issue asks: DPO's increase over SFT, predicted vs measured (goal ±10 %), and
GRPO's peak (goal ±15 %). ``--from-json`` renders an earlier run's table; with ``--re-estimate``
it also estimates every row again with this zeroplan's estimator, through the probe's own estimate
path (no probe runs), in a column beside the estimate the probe printed:

    PYTHONPATH=. python benchmarks/bench_recipe_memory.py --from-json benchmarks/results/recipe_memory.json --re-estimate
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MiB = 2**20


def _ds_config(stage: int, micro: int) -> dict:
    # Trainer fills "auto" from its arguments (transformers/integrations/deepspeed.py); the reduce
    # bucket "auto" is hidden², so the rows differ by the recipe, not by a 500M-element bucket.
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "train_batch_size": 2 * micro,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": "auto"},
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto"}},
            "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}


def _sft_args(config: dict, seq_len: int) -> list[str]:
    """The SFT example's model flags for the same Llama as tiny_llama.json."""
    return ["--layers", str(config["num_hidden_layers"]), "--hidden", str(config["hidden_size"]), "--heads", str(config["num_attention_heads"]),
            "--kv_heads", str(config["num_key_value_heads"]), "--ffn", str(config["intermediate_size"]), "--vocab", str(config["vocab_size"]),
            "--seq_len", str(seq_len)]


def rows_to_run(args) -> list[dict]:
    config = json.loads((EXAMPLES / "tiny_llama.json").read_text())
    seq = args.prompt_len + args.completion_len + 1  # DPOTrainer appends EOS to each answer
    out = []
    for stage in args.stages:
        out.append({"recipe": "sft", "stage": stage, "script": "train_trl_sft.py", "args": _sft_args(config, seq)})
        out.append({"recipe": "dpo", "stage": stage, "script": "train_trl_dpo.py",
                    "args": ["--prompt_len", str(args.prompt_len), "--completion_len", str(args.completion_len)]})
        out.append({"recipe": "grpo", "stage": stage, "script": "train_trl_grpo.py",
                    "args": ["--prompt_len", str(args.prompt_len), "--num_generations", str(args.generations),
                             "--max_completion_length", str(args.grpo_completion_len), "--beta", "0.04"]})
    return out


def probe(row: dict, *, micro: int, tmp: Path, timeout: float) -> dict:
    cfg = tmp / f"z{row['stage']}.json"
    cfg.write_text(json.dumps(_ds_config(row["stage"], micro)))
    cmd = [sys.executable, "-m", "zeroplan", "probe", str(EXAMPLES / row["script"]), "--config", str(cfg), "--config-arg", "--deepspeed",
           "--gpus", "2", "--steps", "2", "--warmup", "1", "--timeout", str(timeout), "--format", "json", "--",
           "--use_cpu", "--report_to", "none", "--output_dir", str(tmp / row["recipe"]), *row["args"]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout + 120)
    try:
        doc = json.loads(r.stdout)
    except json.JSONDecodeError:
        return {"status": "error", "error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
    keep = ("status", "error", "step_time", "peak_memory", "peak_memory_per_rank", "estimated_peak_memory", "estimate_note",
            "recipe", "trl", "frozen_engines", "memory_phases_per_rank", "trainable_params", "discovered_model")
    return {k: doc.get(k) for k in keep}


def _row_seq_len(row: dict, run: dict, settings: dict) -> int:
    """Tokens per sequence the probe's estimate used: the first batch discovery saw, else (runs saved
    before the discovered model was kept) what the examples build — SFT and DPO prompt + answer +
    EOS (DPO's chosen and rejected padded to the longer, equal here: trl/trainer/dpo_trainer.py:185),
    GRPO prompt + the longest completion (completions are padded to it)."""
    seen = (run.get("discovered_model") or {}).get("seq_len")
    if seen:
        return int(seen)
    if row["recipe"] == "grpo":
        return settings["prompt_len"] + settings["grpo_completion_len"]
    return settings["prompt_len"] + settings["completion_len"] + 1


def reestimate(doc: dict) -> None:
    """Each run's estimate again with this zeroplan's estimator, without probing: the probe's own
    path (:func:`zeroplan.runtime.measure.prediction._estimate`: the trainer's bf16 and checkpointing, the
    discovered recipe, TRL's fused head, CPU storage) over the saved run's trainer values and recipe
    and the model the probe discovered (else examples/tiny_llama.json, the examples' model).
    Sets ``reestimated_peak_memory`` and ``reestimate_note`` on every ok run."""
    from zeroplan.dsconfig import plan_from_config
    from zeroplan.profiles.hf_config import model_from_hf_config
    from zeroplan.runtime.api import ProbeRequest
    from zeroplan.runtime.discovery.discover import DiscoveredModel
    from zeroplan.runtime.measure.prediction import _estimate
    from zeroplan.runtime.rank.trainer import trainer_precision

    tiny = model_from_hf_config(EXAMPLES / "tiny_llama.json")
    settings = doc["settings"]
    for row in doc["rows"]:
        config = _ds_config(row["stage"], settings["micro"])
        request = ProbeRequest(script=EXAMPLES / row["script"], nproc=2, ds_config=config, config_arg="--deepspeed",
                               script_args=("--use_cpu", *row["args"]))
        for run in row["runs"]:
            if run.get("status") != "ok":
                continue
            found = run.get("discovered_model")
            model = DiscoveredModel.from_dict(found).model_spec() if found else tiny
            summary = {"model_spec": model.as_dict(), "seq_len": _row_seq_len(row, run, settings), "trl": run.get("trl"),
                       "recipe": run.get("recipe"), "fused_lm_head": True, "memory_kind": "cpu-storage",
                       "trainable_params": run.get("trainable_params"), "frozen_params": 0}
            context: dict = {}
            run["reestimated_peak_memory"], run["reestimate_note"] = _estimate(
                request, plan_from_config(config, 2), config, summary, 2, context, precision=trainer_precision(request.script_args, config))
            recipe = getattr(context.get("est"), "recipe", None)
            if recipe and run["reestimated_peak_memory"]:
                # Each moment as a per-rank total: the peak less the peak moment's bytes above the states, plus its own.
                base = run["reestimated_peak_memory"] - recipe["moments"][recipe["peak_moment"]]
                run["reestimated_moments"] = {name: base + above for name, above in recipe["moments"].items()}
                run["reestimated_terms"] = {**recipe["resident"], **recipe["terms"]}


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(rows: list[dict]) -> list[dict]:
    """Per (recipe, stage): median measured peak, its spread, the estimate and GRPO's phases."""
    out = []
    for row in rows:
        runs = [r for r in row["runs"] if r.get("status") == "ok"]
        peaks = [r["peak_memory"] for r in runs]
        est = runs[0]["estimated_peak_memory"] if runs else None
        now = runs[0].get("reestimated_peak_memory") if runs else None
        note = (runs[0].get("reestimate_note" if "reestimated_peak_memory" in runs[0] else "estimate_note") or "") if runs else ""
        out.append({
            "recipe": row["recipe"], "stage": row["stage"], "runs": len(runs), "of": len(row["runs"]),
            "peak": _median(peaks), "spread": (max(peaks) - min(peaks)) if peaks else None, "probe_estimate": est,
            "estimate": now if runs and "reestimated_peak_memory" in runs[0] else est,
            "note": note if runs else "; ".join(r.get("error") or "" for r in row["runs"]),
            "phases": (runs[0].get("memory_phases_per_rank") or [{}])[0] if runs else {},
            "step_time": _median([r.get("step_time") for r in runs]),
            "moments": (runs[0].get("reestimated_moments") or {}) if runs else {},
        })
    return out


def _fmt(n, scale=MiB, spec=".2f") -> str:
    return "—" if n is None else format(n / scale, spec)


def render(doc: dict) -> str:
    rows = summarise(doc["rows"])
    lines = [f"{doc['date']}  load average {doc['load_before'][0]:.1f} → {doc['load_after'][0]:.1f} on {doc['cpus']} cores; "
             f"{doc['versions']}; repeats {doc['settings']['repeats']}",
             f"2 CPU ranks (gloo), tiny Llama (examples/tiny_llama.json), micro-batch {doc['settings']['micro']}, "
             f"DPO prompt {doc['settings']['prompt_len']} + answer {doc['settings']['completion_len']} tokens, "
             f"GRPO G={doc['settings']['generations']} completions of {doc['settings']['grpo_completion_len']} tokens, beta 0.04",
             ]
    again = doc.get("reestimated")
    if again:
        lines.append(f"est MiB: the estimate the probe printed; now MiB: estimated again {again['date']} at {again['commit']} "
                     "without probing (bench_recipe_memory.py --re-estimate); err: now vs peak")
    lines += ["", f"{'recipe':6} {'stage':>5} {'runs':>5} {'peak MiB':>9} {'spread':>7} {'est MiB':>8}"
              + (f" {'now MiB':>8}" if again else "") + f" {'err':>7} {'step s':>7}  note"]
    for r in rows:
        err = f"{(r['estimate'] - r['peak']) / r['peak']:+.1%}" if r["estimate"] and r["peak"] else "—"
        now = f" {_fmt(r['estimate']):>8}" if again else ""
        lines.append(f"{r['recipe']:6} {r['stage']:>5} {r['runs']:>2}/{r['of']:<2} {_fmt(r['peak']):>9} {_fmt(r['spread']):>7} "
                     f"{_fmt(r['probe_estimate']):>8}{now} {err:>7} {_fmt(r['step_time'], 1, '.3f'):>7}  {r['note'][:90]}")
    lines += ["", "memory phases, rank 0 (live MiB at entry → peak inside the call with the highest peak):"]
    for r in rows:
        if r["recipe"] != "sft" and r["phases"]:
            parts = [f"{name} {_fmt(p['entry_bytes'])}→{_fmt(p['peak_bytes'])}" for name, p in r["phases"].items()]
            lines.append(f"  {r['recipe']} z{r['stage']}: " + "; ".join(parts))
    for r in rows:
        if r["moments"]:
            parts = [f"{name} {_fmt(v)}" for name, v in sorted(r["moments"].items(), key=lambda kv: -kv[1])[:3]]
            lines.append(f"  {r['recipe']} z{r['stage']} estimated now, largest moments (MiB per rank): " + "; ".join(parts))
    lines += ["", "goals: DPO − SFT increase, predicted vs measured (±10 %); GRPO peak (±15 %)"]
    by = {(r["recipe"], r["stage"]): r for r in rows}
    for stage in doc["settings"]["stages"]:
        sft, dpo, grpo = by.get(("sft", stage)), by.get(("dpo", stage)), by.get(("grpo", stage))
        if sft and dpo and sft["peak"] and dpo["peak"]:
            measured = dpo["peak"] - sft["peak"]
            if dpo["estimate"] and sft["estimate"] and "not estimated" not in dpo["note"]:
                predicted = dpo["estimate"] - sft["estimate"]
                verdict = f"predicted {_fmt(predicted)} MiB, error {(predicted - measured) / measured:+.1%}"
            else:
                verdict = "predicted: — (this zeroplan estimates DPO as SFT)"
            lines.append(f"  z{stage} DPO − SFT: measured {_fmt(measured)} MiB; {verdict}")
        if grpo and grpo["peak"]:
            if grpo["estimate"] and "not estimated" not in grpo["note"]:
                lines.append(f"  z{stage} GRPO peak: measured {_fmt(grpo['peak'])} MiB, estimated {_fmt(grpo['estimate'])} MiB, "
                             f"error {(grpo['estimate'] - grpo['peak']) / grpo['peak']:+.1%}")
            else:
                lines.append(f"  z{stage} GRPO peak: measured {_fmt(grpo['peak'])} MiB; estimate: — (this zeroplan estimates GRPO as SFT: "
                             f"{_fmt(grpo['estimate'])} MiB)")
    return "\n".join(lines) + "\n"


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("torch", "deepspeed", "transformers", "trl"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} missing")
    return ", ".join(out)


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return r.stdout.strip() or "an unknown commit"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3])
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=24)
    p.add_argument("--completion-len", type=int, default=24)
    p.add_argument("--generations", type=int, default=2)
    p.add_argument("--grpo-completion-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--only", default="", help="comma-separated recipes to run (default: sft,dpo,grpo)")
    p.add_argument("-o", "--output", type=Path, help="write the table here and the measurements beside it as .json")
    p.add_argument("--from-json", type=Path, help="render an earlier run's .json")
    p.add_argument("--re-estimate", action="store_true", help="with --from-json: estimate every row again with this zeroplan (no probes)")
    args = p.parse_args(argv)
    if args.re_estimate and not args.from_json:
        print("--re-estimate needs --from-json FILE (the run whose rows to estimate again)", file=sys.stderr)
        return 2
    if args.from_json:
        try:
            doc = json.loads(args.from_json.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"--from-json {args.from_json}: not a readable bench_recipe_memory .json ({exc})", file=sys.stderr)
            return 2
        try:
            if args.re_estimate:
                reestimate(doc)
                doc["reestimated"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": _commit()}
            text = render(doc)
        except (KeyError, TypeError, AttributeError) as exc:
            print(f"--from-json {args.from_json}: not a bench_recipe_memory .json (missing or malformed {exc}); "
                  "give a file this bench wrote with -o", file=sys.stderr)
            return 2
        print(text, end="")
        if args.output:
            args.output.write_text(text)
            args.output.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    doc = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "load_before": os.getloadavg(),
           "cpus": os.cpu_count(), "versions": _versions(),
           "settings": {k: getattr(args, k) for k in ("stages", "micro", "prompt_len", "completion_len", "generations", "grpo_completion_len", "repeats")},
           "rows": []}
    only = set(args.only.split(",")) - {""}
    with tempfile.TemporaryDirectory(prefix="bench-recipe-") as tmp:
        for row in rows_to_run(args):
            if only and row["recipe"] not in only:
                continue
            row["runs"] = []
            for i in range(args.repeats):
                run = probe(row, micro=args.micro, tmp=Path(tmp), timeout=args.timeout)
                row["runs"].append(run)
                print(f"{row['recipe']} z{row['stage']} #{i + 1}: {run['status']} peak {_fmt(run.get('peak_memory'))} MiB "
                      f"est {_fmt(run.get('estimated_peak_memory'))} MiB", file=sys.stderr, flush=True)
            doc["rows"].append(row)
    doc["load_after"] = os.getloadavg()
    text = render(doc)
    print(text, end="")
    if args.output:
        args.output.write_text(text)
        args.output.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
