#!/usr/bin/env bash
# Per-rank peak estimate vs probe for tiny Mixtral, DeepSeek-V3 and gpt-oss (random weights from
# examples/*_tiny.json through examples/moe_task.py), ZeRO 1-3 on 2 CPU ranks, fp32.
# Usage: benchmarks/moe_probe_models.sh OUTDIR   (one probe table per model and stage in OUTDIR)
set -u
out=${1:?give an output folder}
mkdir -p "$out"
for model in mixtral deepseek_v3 gpt_oss; do
  for stage in 1 2 3; do
    zeroplan probe examples/moe_task.py --stage "$stage" --gpus 2 --precision fp32 --micro-batch 4 --steps 3 --warmup 2 \
      -- --config "examples/${model}_tiny.json" --seq-len 256 > "$out/${model}_z${stage}.txt" 2>&1
    echo "=== $model stage $stage (rc $?) load $(cut -d' ' -f1-3 /proc/loadavg)"
    grep -E "probe:|peak memory / rank|rank [01] " "$out/${model}_z${stage}.txt" | head -4
  done
done
