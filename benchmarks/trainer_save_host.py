"""Host RSS of each rank across the Hugging Face Trainer's save_model under ZeRO-2 CPU offload (DS_ACCELERATOR=cpu, gloo).

Run: DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/trainer_save_host.py
Every rank should rise by about the bf16 model's bytes (accelerate get_state_dict clones it on every rank at
ZeRO 0-2: zeroplan/estimator/host_save.py); results in benchmarks/results/trainer_save_host.txt.
"""
import os, threading, time, json, ctypes, gc, tempfile
import psutil, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM, Trainer, TrainingArguments
proc = psutil.Process()
class Peak:
    def __init__(self): self.peak = proc.memory_info().rss; self.run = True; self.t = threading.Thread(target=self.loop, daemon=True); self.t.start()
    def loop(self):
        while self.run: self.peak = max(self.peak, proc.memory_info().rss); time.sleep(0.002)
    def stop(self): self.run = False; self.t.join(); return self.peak
cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, num_experts=32, num_experts_per_tok=4, head_dim=64, max_position_embeddings=512)
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
psi = sum(p.numel() for p in model.parameters())
ids = torch.randint(0, 32000, (8, 64))
data = [{"input_ids": r, "labels": r} for r in ids]
ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "bf16": {"enabled": True},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
out = tempfile.mkdtemp(prefix="zp_save_")
args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=1, bf16=True, deepspeed=ds, report_to=[],
                         save_strategy="no", logging_steps=1, use_cpu=True)
tr = Trainer(model=model, args=args, train_dataset=data)
tr.train()
gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
base = proc.memory_info().rss
pk = Peak(); tr.save_model(os.path.join(out, "m")); peak = pk.stop()
print(json.dumps({"rank": int(os.environ["RANK"]), "bf16_bytes": 2 * psi, "rss_peak_above_before_save_model": peak - base}))
import shutil; shutil.rmtree(out, ignore_errors=True)
