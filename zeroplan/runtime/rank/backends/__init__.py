"""Engines that run a zeroplan task: ``deepspeed`` (deepspeed.initialize with the plan's config)
and ``fsdp`` (PyTorch DDP / ZeroRedundancyOptimizer / FSDP2 ``fully_shard``). Imported only
inside probe workers."""

__all__ = ["common", "deepspeed", "fsdp"]
