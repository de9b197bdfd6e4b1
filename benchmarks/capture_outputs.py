"""Write the outputs of `estimate`, `export` and the tuner's search space for a fixed set of
models and clusters into one folder, so two versions of the code can be compared byte for byte.

    python benchmarks/capture_outputs.py OUT_DIR      # on one version
    python benchmarks/capture_outputs.py OUT_DIR2     # on the other
    diff -r OUT_DIR OUT_DIR2                          # no output: identical

A change meant to be output-neutral (a cache, a refactor) must leave the folders identical.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: name -> CLI arguments after ``zeroplan``.
COMMANDS: dict[str, list[str]] = {
    "estimate_175b_64.json": ["estimate", "--params", "175e9", "--gpus", "64", "--cpu-memory", "1024", "--format", "json"],
    "estimate_175b_64.txt": ["estimate", "--params", "175e9", "--gpus", "64", "--cpu-memory", "1024", "--all"],
    "estimate_gpt2_2.json": ["estimate", "--model", "gpt2", "--gpus", "2", "--gpu", "rtx-4090", "--cpu-memory", "64", "--format", "json"],
    "estimate_llama7b_8.json": ["estimate", "--model", "llama-2-7b", "--gpus", "8", "--cpu-memory", "512", "--format", "json"],
    "estimate_llama3_70b_256.json": [
        "estimate", "--model", "llama-3-70b", "--gpus", "256", "--cpu-memory", "2048", "--global-batch", "1024", "--format", "json",
    ],
    "estimate_qwen2_4096.csv": ["estimate", "--model", "qwen2-7b", "--gpus", "4096", "--cpu-memory", "1024", "--format", "csv"],
    "estimate_bloom_512.json": ["estimate", "--model", "bloom-176b", "--gpus", "512", "--cpu-memory", "2048", "--format", "json"],
    "estimate_mistral_lora_16.json": [
        "estimate", "--model", "mistral-7b", "--gpus", "16", "--cpu-memory", "256", "--lora-rank", "16", "--format", "json",
    ],
    "estimate_llama13b_fsdp_16.json": [
        "estimate", "--model", "llama-2-13b", "--gpus", "16", "--cpu-memory", "512", "--engine", "fsdp", "--format", "json",
    ],
    "estimate_gpt2xl_fp16_buckets_4.json": [
        "estimate", "--model", "gpt2-xl", "--gpus", "4", "--cpu-memory", "128", "--precision", "fp16", "--reduce-bucket-size", "5e7",
        "--format", "json",
    ],
    "export_llama7b_8.json": ["export", "--model", "llama-2-7b", "--gpus", "8", "--cpu-memory", "512"],
    "export_175b_64_stage3.json": ["export", "--params", "175e9", "--gpus", "64", "--cpu-memory", "1024", "--stage", "3"],
    "export_mistral_lora_hf.json": ["export", "--model", "mistral-7b", "--gpus", "16", "--cpu-memory", "256", "--lora-rank", "16", "--for", "hf"],
}

#: Help pages, usage errors and the listings: how the command line itself answers.
for _command in ("calibrate", "doctor", "estimate", "export", "probe", "profiles", "tune", "validate"):
    COMMANDS[f"help_{_command}.txt"] = [_command, "-h"]
COMMANDS.update({
    "help_root.txt": ["-h"],
    "no_args.txt": [],
    "profiles.txt": ["profiles"],
    "error_whole_number.txt": ["estimate", "--params", "7e9", "--gpus", "eight"],
    "error_number.txt": ["estimate", "--params", "7e9", "--gpu-memory", "lots"],
    "error_no_value.txt": ["estimate", "--params", "7e9", "--gpus"],
    "error_no_such_option.txt": ["estimate", "--params", "7e9", "--gpuz", "8"],
    "error_no_such_command.txt": ["estimat", "--params", "7e9"],
    "error_missing_script.txt": ["tune"],
    "error_export_stage.txt": ["export", "--params", "7e9", "--stage", "x"],
})

SPACE_SNIPPET = """
from zeroplan.profiles import load_gpu, load_model_preset
from zeroplan.spec import ClusterSpec, TrainingSpec
from zeroplan.tuner.space import build_space
for name, gpus, device in (("gpt2", 2, "cpu"), ("llama-2-7b", 8, "cuda"), ("llama-3-70b", 64, "cuda")):
    model = load_model_preset(name)
    cluster = ClusterSpec(gpus=gpus, gpus_per_node=min(gpus, 8), gpu=load_gpu("a100-80gb"), gpu_memory_bytes=80 * 2**30,
                          cpu_memory_per_node_bytes=512 * 2**30)
    space = build_space(model, cluster, TrainingSpec(seq_len=1024), device=device)
    print(name, gpus, device)
    for c in space.candidates:
        print(repr(c))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    for name, argv in COMMANDS.items():
        r = subprocess.run([sys.executable, "-m", "zeroplan", *argv], capture_output=True, text=True, env=env, cwd=ROOT)
        (args.out / name).write_text(f"exit {r.returncode}\n{r.stdout}\n--- stderr\n{r.stderr}")
        print(f"{name}: exit {r.returncode}, {len(r.stdout)} chars")
    r = subprocess.run([sys.executable, "-c", SPACE_SNIPPET], capture_output=True, text=True, env=env, cwd=ROOT)
    (args.out / "tune_space.txt").write_text(f"exit {r.returncode}\n{r.stdout}\n--- stderr\n{r.stderr}")
    print(f"tune_space.txt: exit {r.returncode}, {len(r.stdout)} chars")


if __name__ == "__main__":
    main()
