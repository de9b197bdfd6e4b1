"""torchtune's chunked cross-entropy, eager and compiled: what it saves and its peak, on CPU.

    PYTHONPATH=. python benchmarks/compiled_loss_memory.py [-o benchmarks/results/compiled_loss_memory.txt]

torchtune's ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/ce_chunked_output_loss.py) runs
``F.cross_entropy(chunk.float(), labels, reduction="sum")`` on each of C = 8 logit chunks; with
``compile=True`` the recipe compiles that method alone (torchtune/training/_compile.py:74-77 at
1814feb17). A compiled graph's buffers are allocated by inductor's wrapper outside any
``TorchDispatchMode``, so zeroplan's CPU tracker cannot see them; this measures them two other
ways, independent of zeroplan's formula:

* saved for backward: every tensor the loss hands autograd (``torch.autograd.graph.saved_tensors_hooks``);
* peak: the running total of the CPU allocator's own allocation records (``torch.profiler`` with
  ``profile_memory=True``: the ``Total Allocated`` of each ``[memory]`` event), from the chunks'
  creation through the backward, above the inputs.

The chunks are ``clone()``s of leaf tensors (a projection's output without the CPU bf16 matmul's
own workspace), so their gradients accumulate in the leaves as they would wait for the output
projection's backward in a model, and each chunk's storage is freed when nothing holds it.
Compared with :func:`zeroplan.estimator.activations.loss_activation_bytes` (``chunked`` and
``chunked-compiled``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(compiled: bool, *, b: int = 2, s: int = 512, v: int = 32000, chunks: int = 8) -> dict:
    """Saved bytes and peak bytes above the inputs of one forward + backward of the chunked loss."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    def compute_cross_entropy(logits, labels):
        return F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum")

    fn = torch.compile(compute_cross_entropy, backend="inductor") if compiled else compute_cross_entropy
    torch.manual_seed(0)
    labels = [y.reshape(-1) for y in torch.randint(0, v, (b, s)).chunk(chunks, dim=1)]

    def run(record: bool):
        leaves = [torch.randn(b * s // chunks, v, dtype=torch.bfloat16, requires_grad=True) for _ in range(chunks)]
        saved: list[int] = []
        seen: set[int] = set()

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                saved.append(t.untyped_storage().nbytes())
            return t

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) if record else _null() as prof:
            logits = [leaf.clone() for leaf in leaves]
            total = 0.0
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                for chunk, y in zip(logits, labels):
                    total = total + fn(chunk, y)
            loss = total / (b * s)
            del logits, chunk  # the recipe's ``del logits`` before backward
            loss.backward()
        return prof, saved

    run(False)  # compile and warm up
    prof, saved = run(True)
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    events = sorted((e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    os.unlink(path)
    totals = [e["args"]["Total Allocated"] for e in events]
    base = totals[0] - events[0]["args"]["Bytes"]
    return {"tokens": b * s, "vocab": v, "chunks": chunks, "saved_bytes": sum(saved), "peak_bytes": max(totals) - base}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main(argv=None) -> int:
    from zeroplan.estimator.activations import loss_activation_bytes
    from zeroplan.spec import ModelSpec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path)
    args = parser.parse_args(argv)
    lines = [f"{'loss':<18} {'N·V':>11} {'saved (×N·V)':>13} {'peak (×N·V)':>12} {'predicted':>10} {'error':>7}"]
    for name, compiled in (("chunked", False), ("chunked-compiled", True)):
        r = measure(compiled)
        nv = r["tokens"] * r["vocab"]
        model = ModelSpec(name="x", params=10**6, hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=4, ffn_size=1024,
                          vocab_size=r["vocab"], tied_embeddings=True, gated_mlp=True)
        # The chunks' clones are counted above the inputs; the peak's prediction is the loss's term.
        pred = sum(loss_activation_bytes(model, seq_len=r["tokens"], micro_batch=1, precision="bf16", loss=name).values())
        lines.append(f"{name:<18} {nv:>11} {r['saved_bytes'] / nv:>13.3f} {r['peak_bytes'] / nv:>12.3f} {pred / nv:>10.3f} "
                     f"{(pred - r['peak_bytes']) / r['peak_bytes']:>+7.2%}")
    import torch

    lines += ["", f"torch {torch.__version__}, CPU, inductor; bf16 chunks of N = 1024 tokens, V = 32000, C = 8; "
              "saved: distinct storages handed to autograd; peak: CPU allocator records above the inputs."]
    text = "\n".join(lines)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
