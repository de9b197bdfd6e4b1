"""Write every plan's full estimate of the speed sweep, and `zeroplan estimate --format json` over a
set of options, into one folder, so two versions of the estimator can be compared byte for byte.

    python benchmarks/dump_estimates.py OUT_DIR      # on one version
    python benchmarks/dump_estimates.py OUT_DIR2     # on the other
    diff -r OUT_DIR OUT_DIR2                         # no output: identical

``sweep.txt`` holds, for each (model size, cluster) of :mod:`bench_estimate_speed`'s sweep, the
ranked plans' ``repr`` (every field of every result object, moments and breakdowns included, in
their order) and their ``as_dict()`` JSON; the ``estimate_*.json`` files are the command line's
output with the options in :data:`ESTIMATES` (stage, offloads, NVMe, fsdp, fsdp1, recipes, MoE
and MLA presets, LoRA/QLoRA, layouts, context parallelism). A change meant to be output-neutral
(a cache, work moved out of the per-plan loop) must leave the folders identical.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name -> `zeroplan estimate` arguments (JSON output added).
ESTIMATES: dict[str, list[str]] = {
    "175b_64": ["--params", "175e9", "--gpus", "64", "--cpu-memory", "1024"],
    "llama70b_stage3_offload": ["--model", "llama-2-70b", "--gpus", "16", "--cpu-memory", "2048", "--stage", "3",
                                "--offload-optimizer", "cpu", "--offload-param", "cpu"],
    "175b_nvme": ["--params", "175e9", "--gpus", "16", "--cpu-memory", "1024", "--stage", "3", "--offload-optimizer", "nvme",
                  "--nvme", "8000"],
    "llama8b_fsdp": ["--model", "llama-3-8b", "--gpus", "8", "--cpu-memory", "512", "--engine", "fsdp"],
    "llama13b_fsdp1": ["--model", "llama-2-13b", "--gpus", "16", "--cpu-memory", "512", "--engine", "fsdp1"],
    "llama8b_dpo": ["--model", "llama-3-8b", "--gpus", "8", "--cpu-memory", "1024", "--recipe", "dpo"],
    "llama8b_grpo_vllm": ["--model", "llama-3-8b", "--gpus", "8", "--cpu-memory", "1024", "--recipe", "grpo",
                          "--vllm-gpu-memory", "0.3"],
    "mixtral_ep": ["--model", "mixtral-8x7b", "--gpus", "32", "--cpu-memory", "2048", "--ep", "auto"],
    "qwen3_30b_a3b": ["--model", "qwen3-30b-a3b", "--gpus", "16", "--cpu-memory", "1024"],
    "deepseek_v3": ["--model", "deepseek-v3", "--gpus", "256", "--cpu-memory", "2048"],
    "llama8b_cp": ["--model", "llama-3-8b", "--gpus", "16", "--cpu-memory", "1024", "--engine", "fsdp", "--cp", "auto",
                   "--seq-len", "65536"],
    "llama8b_sp_tp": ["--model", "llama-3-8b", "--gpus", "16", "--cpu-memory", "1024", "--sp", "1,2,4", "--tp", "1,2",
                      "--seq-len", "32768", "--tiled-mlp"],
    "mistral_qlora": ["--model", "mistral-7b", "--gpus", "4", "--cpu-memory", "256", "--lora-rank", "16", "--base-quant", "nf4"],
    "gpt2xl_fp16_eager": ["--model", "gpt2-xl", "--gpus", "4", "--cpu-memory", "128", "--precision", "fp16", "--no-flash",
                          "--expandable-segments", "--buckets", "deepspeed", "--overlap-comm", "off", "--model-save", "engine"],
    "llama70b_global_batch": ["--model", "llama-3-70b", "--gpus", "256", "--cpu-memory", "2048", "--global-batch", "1024"],
}


def dump_sweep(path: Path) -> int:
    """The speed sweep's plans (bench_estimate_speed.SWEEP_SNIPPET), ranked, one line each: repr, then JSON."""
    from zeroplan.estimator import enumerate_plans, estimate_all
    from zeroplan.profiles import load_gpu
    from zeroplan.spec import ClusterSpec, TrainingSpec, derive_shape_from_params

    gpu = load_gpu("a100-80gb")
    training = TrainingSpec()
    count = 0
    with path.open("w") as out:
        for params in (1.3e9, 7e9, 13e9, 30e9, 70e9, 175e9, 530e9):
            model = derive_shape_from_params(params)
            for gpus in (8, 32, 128, 512, 1024, 4096):
                cluster = ClusterSpec(gpus=gpus, gpus_per_node=8, gpu=gpu, gpu_memory_bytes=80 * 2**30,
                                      cpu_memory_per_node_bytes=1024 * 2**30)
                out.write(f"# {params:g} params, {gpus} GPUs\n")
                for e in estimate_all(model, cluster, training, enumerate_plans(model, cluster, training)):
                    out.write(repr(e) + "\n")
                    out.write(json.dumps(e.as_dict(), sort_keys=False) + "\n")
                    count += 1
    return count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--no-cli", action="store_true", help="the sweep only")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"sweep: {dump_sweep(args.out / 'sweep.txt')} plans")
    if args.no_cli:
        return
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name, options in ESTIMATES.items():
        r = subprocess.run([sys.executable, "-m", "zeroplan", "estimate", *options, "--format", "json"],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        (args.out / f"estimate_{name}.json").write_text(f"exit {r.returncode}\n{r.stdout}{r.stderr}")
        print(f"{name}: exit {r.returncode}, {len(r.stdout)} characters")


if __name__ == "__main__":
    main()
