"""Optimizer in backward, measured on CPU: how many gradients are alive, and the step's peak.

    PYTHONPATH=. python benchmarks/optimizer_in_backward.py [-o benchmarks/results/optimizer_in_backward.txt]

torchtune's ``optimizer_in_bwd: True`` (fef3ed10: recipes/full_finetune_single_device.py:277-284,
torchtune/utils/memory.py:142-160) gives every parameter its own optimizer and steps it in
``register_post_accumulate_grad_hook``, then ``zero_grad()``. This runs one training step of a
tiny bf16 Llama (transformers, untied head) both ways — ``torch.optim.AdamW`` over all parameters
stepped after ``backward()``, and one AdamW per parameter stepped in its hook — and reports:

* the largest sum of live ``.grad`` bytes seen at any hook (in-backward) or before the step
  (after backward), against the largest trainable tensor's gradient and all of them;
* the step's peak of live tensor storage (zeroplan's CPU tracker, parameters and optimizer
  states included), against ``estimate_all(..., engine="fsdp", device="cpu")`` with
  ``TrainingSpec(optimizer_in_backward=...)``, precision bf16-pure, loss ``hf``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 4, "vocab_size": 8192, "tie_word_embeddings": False, "max_position_embeddings": 512}
BATCH, SEQ = 1, 32


def measure(in_backward: bool) -> dict:
    """Max live gradient bytes and the step's peak storage bytes (after one warm-up step)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from zeroplan.runtime.measure.memory import StorageTracker

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="sdpa")).to(torch.bfloat16)
    params = list(model.parameters())
    grad_peak = [0]

    def live_grads() -> int:
        return sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)

    if in_backward:
        optims = {p: torch.optim.AdamW([p], lr=1e-4) for p in params}

        def optim_step(p):
            grad_peak[0] = max(grad_peak[0], live_grads())
            optims[p].step()
            optims[p].zero_grad()

        for p in params:
            p.register_post_accumulate_grad_hook(optim_step)
        optimizers = list(optims.values())
    else:
        optim = torch.optim.AdamW(params, lr=1e-4)
        optimizers = [optim]

    def states() -> list:
        return [t for o in optimizers for st in o.state.values() for t in st.values() if torch.is_tensor(t)]

    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        if not in_backward:
            grad_peak[0] = max(grad_peak[0], live_grads())
            optim.step()
            optim.zero_grad(set_to_none=True)
        del out

    step()  # creates the optimizer states
    grad_peak[0] = 0
    tracker = StorageTracker("cpu")
    with tracker:
        tracker.track(*params, *states())
        base = tracker.current_bytes
        step()
    largest = max(p.numel() for p in params) * 2
    return {"max_live_grad_bytes": grad_peak[0], "largest_grad_bytes": largest, "all_grad_bytes": sum(p.numel() for p in params) * 2,
            "peak_bytes": tracker.peak_bytes, "states_and_params_bytes": base}


def predict(in_backward: bool) -> int:
    """zeroplan's peak allocated bytes for the same step (engine fsdp, one CPU process)."""
    from zeroplan.estimator import enumerate_plans, estimate_all
    from zeroplan.profiles.resolve import resolve_cluster, resolve_model
    from zeroplan.spec import TrainingSpec

    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.json"
        cfg.write_text(json.dumps(CONFIG))
        model = resolve_model(None, str(cfg))
    cluster = resolve_cluster(gpus=1, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=None, nvme_gib=None)
    training = TrainingSpec(precision="bf16-pure", seq_len=SEQ, micro_batch=BATCH, grad_accum=1, loss="hf", optimizer_in_backward=in_backward)
    plans = enumerate_plans(model, cluster, training, stage=0, offload_optimizer="none", offload_param="none", checkpointing="none", engine="fsdp")
    (est,) = estimate_all(model, cluster, training, plans, device="cpu", engine="fsdp", optimizer_impl="torch")
    return est.gpu.peak_allocated


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args(argv)
    MiB = 2**20
    lines = [f"{'optimizer step':<22} {'max live grads':>14} {'largest grad':>12} {'all grads':>10} {'peak':>9} {'predicted':>9} {'error':>7}"]
    for name, in_backward in (("after backward", False), ("in backward", True)):
        r = measure(in_backward)
        pred = predict(in_backward)
        lines.append(f"{name:<22} {r['max_live_grad_bytes'] / MiB:>12.2f} M {r['largest_grad_bytes'] / MiB:>10.2f} M "
                     f"{r['all_grad_bytes'] / MiB:>8.2f} M {r['peak_bytes'] / MiB:>7.1f} M {pred / MiB:>7.1f} M "
                     f"{(pred - r['peak_bytes']) / r['peak_bytes']:>+7.1%}")
    import torch

    lines += ["", f"torch {torch.__version__}, CPU, one process; tiny Llama {CONFIG['num_hidden_layers']} layers, h {CONFIG['hidden_size']}, "
              f"V {CONFIG['vocab_size']} untied, bf16 weights and AdamW states, batch {BATCH} x {SEQ}, torch.optim.AdamW (CPU: for-loop)"]
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
