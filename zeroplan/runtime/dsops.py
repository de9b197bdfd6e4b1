"""DeepSpeed ops that training never calls, kept from compiling on the CPU accelerator."""

from __future__ import annotations

__all__ = ["skip_shm_comm_op"]


def skip_shm_comm_op() -> None:
    """Mark DeepSpeed's shared-memory all-reduce op (``deepspeed_shm_comm``) unavailable on the
    CPU accelerator; call before the process group starts.

    ``deepspeed/comm/torch.py``: ``TorchBackend.__init__`` loads the op at every
    ``init_distributed`` through ``build_shm_op`` — on a fresh machine a JIT compile of
    ``csrc/cpu/comm/shm.cpp`` (about a minute of CPU) — yet only ``inference_all_reduce`` calls
    it; the collectives a training engine runs (``all_reduce``, ``all_gather_into_tensor``,
    ``reduce_scatter_tensor``, …) go to ``torch.distributed`` with or without it.
    ``build_shm_op`` returns None for an op that ``deepspeed.ops.__compatible_ops__`` marks
    incompatible (as it does off Linux), and ``inference_all_reduce`` then falls back to
    ``torch.distributed.all_reduce``. Other accelerators have no such op: nothing changes there.
    """
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return
    if get_accelerator()._name != "cpu":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
