"""How many parameters ZeRO-3 holds gathered at once for an MoE model with fused experts, on CPU ranks.

    PYTHONPATH=. DS_ACCELERATOR=cpu python -m torch.distributed.run --nproc_per_node 2 \
        benchmarks/zero3_moe_gathered.py -- --max-live 1000

Builds examples/moe_task.py's tiny Qwen3-MoE (transformers 5: each layer's experts are one module
with ``gate_up_proj [E, 2I, h]`` and ``down_proj [E, h, I]``) under DeepSpeed stage 3 with the
config ``zeroplan export`` writes and ``stage3_max_live_parameters`` / ``stage3_prefetch_bucket_size``
set to ``--max-live`` (and ``stage3_max_reuse_distance`` to ``--reuse-distance``), runs three steps, and on rank 0 records, at every module's forward and
backward hook of the third step, the non-persistent parameters DeepSpeed's own ``ds_status``
reports gathered (AVAILABLE or INFLIGHT). Prints the largest such set next to zeroplan's
``gathered_params`` term (zeroplan.estimator.memory.engine_overhead) in elements.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> int:
    import dataclasses

    import deepspeed
    import torch
    import torch.distributed as dist

    import moe_task
    from zeroplan.dsconfig import build_config
    from zeroplan.estimator.memory import engine_overhead
    from zeroplan.profiles.resolve import resolve_cluster
    from zeroplan.spec import Plan, TrainingSpec

    p = argparse.ArgumentParser()
    p.add_argument("--max-live", type=int, default=None, help="stage3_max_live_parameters and prefetch bucket (default: DeepSpeed's)")
    p.add_argument("--reuse-distance", type=int, default=None, help="stage3_max_reuse_distance (default: DeepSpeed's)")
    own, rest = p.parse_known_args([a for a in sys.argv[1:] if a != "--"])
    args = moe_task.parse_args(rest)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    knobs = {} if own.max_live is None else {"stage3_max_live_parameters": own.max_live, "stage3_prefetch_bucket_size": own.max_live}
    if own.reuse_distance is not None:
        knobs["stage3_max_reuse_distance"] = own.reuse_distance
    plan = Plan(micro_batch=2, stage=3, **knobs)
    training = TrainingSpec(precision="fp32", seq_len=args.seq_len)
    spec = moe_task.model_spec(args)
    config = build_config(plan, world_size=world, training=training, model=spec)
    model = moe_task.build_model(args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = dist.get_rank()
    params = [q for q in engine.module.parameters()]
    state = {"record": False, "max": 0, "where": ""}

    def gathered(where: str) -> None:
        if not state["record"]:
            return
        n = sum(q.ds_numel for q in params if not q.ds_persist and str(q.ds_status).split(".")[-1] in ("AVAILABLE", "INFLIGHT"))
        if n > state["max"]:
            state.update(max=n, where=where)

    for name, module in engine.module.named_modules():
        module.register_forward_hook(lambda m, i, o, n=name: gathered(f"forward {n or '<root>'}"))
        module.register_full_backward_hook(lambda m, gi, go, n=name: gathered(f"backward {n or '<root>'}"))

    for step in range(3):
        state["record"] = step == 2
        x, y = moe_task.make_batch(moe_task._config(args.config)["vocab_size"], args.seq_len, 2, step, rank)
        loss = moe_task.lm_loss(engine, (x, y))
        engine.backward(loss)
        engine.step()
    if rank == 0:
        cluster = resolve_cluster(gpus=world, gpus_per_node=world, gpu="h100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
        predicted = engine_overhead(spec, cluster, training, plan, device="cpu").during_backward["gathered_params"] // 4
        persistent = sum(q.ds_numel for q in params if q.ds_persist)
        experts = spec.moe.layer_experts_params
        print(f"max_live={own.max_live or 'default'} reuse_distance={own.reuse_distance}: measured gathered (non-persistent) {state['max']:,} elements at {state['where']}; "
              f"zeroplan gathered_params {predicted:,} (one layer's experts {experts:,}; persistent {persistent:,}; total {spec.params:,}); "
              f"error {100 * (predicted - state['max']) / state['max']:+.1f}%", flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
