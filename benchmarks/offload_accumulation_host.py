"""Host bytes of ZeRO-1/2's CPU-offload gradient-accumulation buffers (gradient_accumulation_steps > 1), per rank.

With ``offload_optimizer`` and more than one micro-step per optimizer step, DeepSpeed keeps, for every
parameter in a rank's partition, a host buffer of that parameter's whole gradient in the training dtype
(stage_1_and_2.py ``async_accumulate_grad_in_cpu_via_gpu`` / ``accumulated_grads_in_cpu``; pinned on
CUDA). This runs a tiny Qwen3-MoE (transformers' own model, random weights) under ZeRO-``STAGE`` with
CPU offload on gloo ranks (DS_ACCELERATOR=cpu) for two optimizer steps at ``GA`` micro-steps, and
prints per rank: the bytes of the engine's own ``accumulated_grads_in_cpu`` buffers, the resident-set
size after the steps (glibc trimmed), and zeroplan's formula for the same run.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/offload_accumulation_host.py GA STAGE

Results: benchmarks/results/offload_accumulation_host.txt.
"""
import ctypes
import gc
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import psutil  # noqa: E402
import torch  # noqa: E402
import deepspeed  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from zeroplan.runtime.rank.dsops import skip_shm_comm_op  # noqa: E402

ga = int(sys.argv[1]) if len(sys.argv) > 1 else 2
stage = int(sys.argv[2]) if len(sys.argv) > 2 else 2
skip_shm_comm_op()
deepspeed.init_distributed(dist_backend="gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, num_experts=32,
                     num_experts_per_tok=4, head_dim=64, max_position_embeddings=512)
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
sizes = [p.numel() for p in model.parameters()]
ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": ga, "bf16": {"enabled": True},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
x = torch.randint(0, 32000, (1, 64))
for _ in range(2 * ga):
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
buffers = getattr(engine.optimizer, "accumulated_grads_in_cpu", {}) or {}
held = sum(t.numel() * t.element_size() for t in buffers.values())
from zeroplan.estimator.host import offload_accumulation_bytes  # noqa: E402

formula = offload_accumulation_bytes(tuple(sizes), world_size=world, bytes_per_param=2, pinned=False)
out = {"rank": rank, "world": world, "stage": stage, "ga": ga, "params": sum(sizes), "tensors": len(sizes),
       "accumulated_grads_in_cpu_bytes": held, "buffers": len(buffers), "formula_bytes": formula,
       "rss_after_steps": psutil.Process().memory_info().rss, "versions": [torch.__version__, deepspeed.__version__]}
print("RESULT " + json.dumps(out), flush=True)
