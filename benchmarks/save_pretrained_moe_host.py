"""Host RSS of transformers' save_pretrained of a tiny Qwen3-MoE (transformers 5: fused experts written back as per-expert tensors).

Run: python benchmarks/save_pretrained_moe_host.py; results in benchmarks/results/trainer_save_host.txt.
"""
import os, threading, time, json, ctypes, gc, tempfile, psutil, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
proc = psutil.Process()
class Peak:
    def __init__(self): self.peak = proc.memory_info().rss; self.run = True; self.t = threading.Thread(target=self.loop, daemon=True); self.t.start()
    def loop(self):
        while self.run: self.peak = max(self.peak, proc.memory_info().rss); time.sleep(0.001)
    def stop(self): self.run = False; self.t.join(); return self.peak
cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=4, num_experts=32, num_experts_per_tok=4, head_dim=64, max_position_embeddings=512)
model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
print({k: tuple(v.shape) for k, v in sd.items() if "layers.0.mlp" in k})
experts = sum(v.numel()*2 for k, v in sd.items() if "experts" in k)
for mode in ("with_state_dict", "own"):
    gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
    d = tempfile.mkdtemp(); base = proc.memory_info().rss; pk = Peak()
    if mode == "own": model.save_pretrained(d)
    else: model.save_pretrained(d, state_dict=dict(sd))
    peak = pk.stop() - base
    import safetensors; from safetensors import safe_open
    keys = []
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as h: keys += list(h.keys())
    print(mode, json.dumps({"rss_peak": peak, "bf16_bytes": sum(v.numel()*2 for v in sd.values()), "expert_bytes": experts, "n_keys_written": len(keys), "sample": [k for k in keys if "layers.0.mlp.experts" in k][:3]}))
    import shutil; shutil.rmtree(d)
