"""Run a zeroplan task under ``deepspeed.initialize`` with a DeepSpeed config file."""

from __future__ import annotations

from zeroplan.runtime.rank.backends.common import apply_checkpointing, device_for_rank, task_blocks, to_device

__all__ = ["run_deepspeed"]


def run_deepspeed(task, *, config_path: str, plan, meter) -> None:
    """Build the model, hand it to DeepSpeed, train until ``meter`` stops the loop.

    ``deepspeed.initialize`` is the wrapped one (see zeroplan.runtime.rank.worker), so the engine's
    optimizer steps feed ``meter`` exactly as in a user's own DeepSpeed script.
    """
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="nccl" if device_for_rank().type == "cuda" else "gloo")
    model = task.build_model()
    if plan is not None:
        apply_checkpointing(task_blocks(task, model), plan.checkpointing)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config_path)
    rank = dist.get_rank()
    micro_batch = engine.train_micro_batch_size_per_gpu()
    step = 0
    while True:
        batch = to_device(task.make_batch(micro_batch, step, rank), engine.device)
        loss = task.loss_fn(engine, batch)
        engine.backward(loss)
        engine.step()
        step += 1
