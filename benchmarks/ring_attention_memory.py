"""PyTorch's ring attention (context parallelism) on gloo ranks: its backward's live-storage peak
against zeroplan's formula, and its output against SDPA over the whole sequence.

Each rank calls torch's own ``_templated_ring_attention`` and ``_templated_ring_attention_backward``
(``torch/distributed/tensor/experimental/_context_parallel/_attention.py``: the default all-gather
K/V rotation, load balancing on, fp32 merge and accumulation) with the CPU flash-attention kernels
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward), on bf16 q, k, v of the
load-balanced chunks r and 2cp−1−r of one sequence. zeroplan's ``StorageTracker`` (the live tensor
storage the CPU probes measure) gives the backward's peak above its inputs, which is compared with
:func:`zeroplan.estimator.context_parallel.ring_attention_backward_bytes` for one layer; the
output is compared with ``scaled_dot_product_attention`` over the whole sequence on the same chunks.

    PYTHONPATH=. python benchmarks/ring_attention_memory.py [--cp 2 4] [--shape 1,4,512,16] [--out FILE] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

#: (batch, heads, sequence, head dim) shapes measured for each cp.
SHAPES = ((1, 4, 512, 16), (2, 2, 256, 32))


def _rank(rank: int, world: int, port: int, shape: tuple, path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring

    from zeroplan.runtime.measure.memory import StorageTracker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    b, h, s, d = shape
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16) for _ in range(3)]

    def mine(t):
        chunks = t.chunk(2 * world, dim=2)
        return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=2).contiguous()

    q, k, v = (mine(t) for t in full)
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    group = dist.group.WORLD
    tracker = StorageTracker()
    with tracker:
        tracker.track(q, k, v)
        out, lse = ring._templated_ring_attention(group, 2, forward, q, k, v, is_causal=True)[:2]
        grad = torch.ones_like(out)
        tracker.track(out, lse, grad)
        tracker.peak_bytes = base = tracker.current_bytes
        ring._templated_ring_attention_backward(group, 2, backward, grad, "grad_out", q, k, v, out, lse, is_causal=True, dropout_p=0.0)
        peak = tracker.peak_bytes - base
    reference = torch.nn.functional.scaled_dot_product_attention(*[t.float() for t in full], is_causal=True)
    error = (out.float() - mine(reference)).abs().max().item()
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    if rank == 0:
        Path(path).write_text(json.dumps({"peaks": peaks, "max_abs_error": error}))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(cp: int, shape: tuple) -> dict:
    """Run the ring on ``cp`` gloo ranks for ``shape`` (b, heads, s, d); the ranks' backward peaks
    (bytes above their inputs), the output's largest deviation from SDPA, and zeroplan's figure."""
    import torch.multiprocessing as mp

    from zeroplan.estimator.context_parallel import ring_attention_backward_bytes
    from zeroplan.spec import ModelSpec

    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "out.json")
        mp.spawn(_rank, args=(cp, _free_port(), shape, path), nprocs=cp)
        measured = json.loads(Path(path).read_text())
    b, h, s, d = shape
    model = ModelSpec(name="ring", params=1, hidden_size=h * d, num_layers=1, num_heads=h, num_kv_heads=h, ffn_size=1, vocab_size=1)
    terms = ring_attention_backward_bytes(model, seq_len=s, micro_batch=b, precision="bf16", cp=cp)
    return {"cp": cp, "shape": shape, **measured, "predicted": sum(terms.values()), "terms": terms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--shape", help="one shape b,heads,s,d instead of the defaults")
    parser.add_argument("--json", type=Path, help="also write the measurements as JSON")
    args = parser.parse_args(argv)
    shapes = (tuple(int(x) for x in args.shape.split(",")),) if args.shape else SHAPES
    results = []
    lines = [f"{'cp':>3} {'b,heads,s,d':>14} {'measured peak (max over ranks)':>31} {'predicted':>10} {'error':>7} {'|out - SDPA|':>13}"]
    for cp in args.cp:
        for shape in shapes:
            r = measure(cp, shape)
            results.append(r)
            worst = max(r["peaks"])
            lines.append(f"{cp:>3} {','.join(map(str, shape)):>14} {worst:>31,} {r['predicted']:>10,} "
                         f"{(r['predicted'] - worst) / worst:>+7.1%} {r['max_abs_error']:>13.4f}   ranks {r['peaks']}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
