"""Host RSS at a ZeRO-2 CPU-offload save on one gloo rank (DS_ACCELERATOR=cpu): what accelerate's get_state_dict adds
(clone_tensors_for_torch_save of the module's state dict) and what engine.save_checkpoint adds. Results: benchmarks/results/trainer_save_host.txt."""
import os, sys, threading, time, tempfile, json
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29517")
os.environ.setdefault("RANK", "0"); os.environ.setdefault("WORLD_SIZE", "1"); os.environ.setdefault("LOCAL_RANK", "0")
import psutil, torch, deepspeed
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save

proc = psutil.Process()
def rss(): return proc.memory_info().rss
class Peak:
    def __init__(self): self.peak = rss(); self.run = True; self.t = threading.Thread(target=self.loop, daemon=True); self.t.start()
    def loop(self):
        while self.run: self.peak = max(self.peak, rss()); time.sleep(0.002)
    def stop(self): self.run = False; self.t.join(); return max(self.peak, rss())

cfg = Qwen3MoeConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, num_experts=32,
                     num_experts_per_tok=4, head_dim=64, max_position_embeddings=512)
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
psi = sum(p.numel() for p in model.parameters())
ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
x = torch.randint(0, 32000, (1, 64))
loss = engine(input_ids=x, labels=x).loss; engine.backward(loss); engine.step()
import gc, ctypes; gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
base = rss()
pk = Peak(); sd = clone_tensors_for_torch_save(engine.module.state_dict()); held = rss() - base; peak = pk.stop() - base
sd_bytes = sum(t.numel() * t.element_size() for t in sd.values())
del sd; gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
base2 = rss()
with tempfile.TemporaryDirectory() as d:
    pk = Peak(); engine.save_checkpoint(d); peak_ds = pk.stop() - base2
    files = {f: os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs}
print(json.dumps({"params": psi, "bf16_bytes": 2 * psi, "state_dict_clone_bytes": sd_bytes,
                  "rss_delta_after_clone": held, "rss_peak_during_clone": peak,
                  "rss_peak_during_save_checkpoint": peak_ds, "files": files,
                  "versions": [torch.__version__, deepspeed.__version__]}, indent=1))
