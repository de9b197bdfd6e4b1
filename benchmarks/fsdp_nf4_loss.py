"""QLoRA under FSDP2 computes what the unsharded model computes, on CPU ranks.

    PYTHONPATH=. python -m torch.distributed.run --nproc_per_node 2 benchmarks/fsdp_nf4_loss.py

examples/lora_task.py's Llama with an NF4 base (``--base-quant nf4``) and LoRA r 8 on
all-linear, built twice with the same seed: once left whole (the loss under bf16 autocast), once
wrapped by zeroplan's FSDP2 backend at stage 3 (``fully_shard`` per block and at the root,
bf16 ``MixedPrecisionPolicy``). Prints, per rank, the NF4 weight's type, dtype and local shard
shape after wrapping, and both losses on the same batch. Findings: docs/peft.md (QLoRA rows).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]


def main() -> int:
    import torch
    import torch.distributed as dist

    import lora_task
    from zeroplan.runtime.rank.backends.fsdp import wrap_model
    from zeroplan.spec import Plan

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    args = lora_task.parse_args(["--rank", "8", "--targets", "all-linear", "--base-quant", "nf4"])
    batch = lora_task.make_batch(args, 2, 0, 0)
    whole = lora_task.build_model(args)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = lora_task.lm_loss(whole, batch).item()
    model = lora_task.build_model(args)
    model, kind = wrap_model(model, blocks=lora_task.blocks(model), plan=Plan(stage=3, micro_batch=2), precision="bf16",
                             device=torch.device("cpu"))
    loss = lora_task.lm_loss(model, batch)
    loss.backward()
    weight = lora_task.blocks(model)[1].self_attn.q_proj.base_layer.weight
    print(f"rank {rank}: {kind}, q_proj weight {type(weight).__name__} {weight.dtype} {tuple(weight.shape)}, local shard "
          f"{tuple(weight.to_local().shape)}; loss whole {reference:.5f}, FSDP2 {loss.item():.5f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
