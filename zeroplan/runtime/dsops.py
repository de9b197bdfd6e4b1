"""DeepSpeed ops that training never calls, kept from compiling on the CPU accelerator."""

from __future__ import annotations

__all__ = ["OPTIMIZER_OPS", "build_ops", "optimizer_ops_for", "skip_shm_comm_op", "unbuilt_ops"]


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


#: Op name of each optimizer builder a DeepSpeed plan loads (deepspeed/ops/op_builder): FusedAdam
#: for a config's ``optimizer`` block without offload, DeepSpeedCPUAdam with optimizer offload.
OPTIMIZER_OPS = {"FusedAdamBuilder": "fused_adam", "CPUAdamBuilder": "cpu_adam"}

#: A lock file older than this, with no build tool running, belongs to a build that was killed.
STALE_LOCK_AGE_S = 30.0

_BUILD = """
import os, sys, time
import torch
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the probe worker sets it without CUDA
from zeroplan.runtime.dsops import skip_shm_comm_op
skip_shm_comm_op()
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import installed_ops
for name in sys.argv[1:]:
    builder = get_accelerator().create_op_builder(name)
    if builder is None or installed_ops.get(builder.NAME, False):
        continue
    start = time.monotonic()
    builder.load(verbose=False)
    print(builder.NAME, round(time.monotonic() - start, 1), flush=True)
"""


def optimizer_ops_for(plans, *, optimizer_block: bool) -> tuple[str, ...]:
    """The optimizer op builders ``plans`` load: FusedAdam when a plan keeps the optimizer on the
    device and the config has an ``optimizer`` block (deepspeed/runtime/engine.py
    ``_configure_basic_optimizer``), DeepSpeedCPUAdam when a plan offloads it."""
    out = []
    if optimizer_block and any(p.offload_optimizer == "none" for p in plans):
        out.append("FusedAdamBuilder")
    if any(p.offload_optimizer != "none" for p in plans):
        out.append("CPUAdamBuilder")
    return tuple(out)


def unbuilt_ops(builders: tuple[str, ...]) -> tuple[str, ...]:
    """The builders whose op is not in torch's extensions cache yet (a JIT build's ``<name>.so``,
    torch.utils.cpp_extension ``_get_build_directory``; ops DeepSpeed was installed with are
    found by :func:`build_ops` itself)."""
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    return tuple(b for b in builders if not (Path(_get_build_directory(OPTIMIZER_OPS[b], False)) / f"{OPTIMIZER_OPS[b]}.so").exists())


def build_ops(builders: tuple[str, ...], *, timeout_s: float = 1800.0) -> dict[str, float]:
    """JIT-compile DeepSpeed ``builders`` once, in a child process, before any probe: a probe whose
    engine compiles an op on first use spends minutes in it (DeepSpeedCPUAdam: ~110 s of CPU
    here), past a timeout derived for the plan, and a build killed half-way leaves its lock file
    behind, on which every later build waits. Returns seconds per op built (ops installed with
    DeepSpeed are skipped); RuntimeError with the build's last line when it fails."""
    import subprocess
    import sys

    for builder in builders:
        _drop_stale_lock(OPTIMIZER_OPS.get(builder))
    r = subprocess.run([sys.executable, "-c", _BUILD, *builders], capture_output=True, text=True, timeout=timeout_s,
                       start_new_session=True)
    if r.returncode != 0:
        last = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip()), f"exit code {r.returncode}")
        raise RuntimeError(f"building DeepSpeed's {', '.join(builders)} failed: {last}")
    return {name: float(secs) for name, secs in (ln.split() for ln in r.stdout.splitlines() if len(ln.split()) == 2)}


def _drop_stale_lock(name: str | None) -> None:
    """Remove the lock file a killed build of op ``name`` left in torch's extensions cache: with no
    ``<name>.so``, older than :data:`STALE_LOCK_AGE_S` and no build tool running on this machine,
    nothing holds it, and torch's ``FileBaton`` would make every later build of the op wait on it
    for ever."""
    if name is None:
        return
    from pathlib import Path

    from torch.utils.cpp_extension import _get_build_directory

    folder = Path(_get_build_directory(name, False))
    lock = folder / "lock"
    if not lock.exists() or (folder / f"{name}.so").exists():
        return
    import time

    # A build writes build.ninja and starts ninja within moments of taking the lock.
    if time.time() - lock.stat().st_mtime < STALE_LOCK_AGE_S or _build_tools_running():
        return
    lock.unlink(missing_ok=True)


def _build_tools_running() -> bool:
    """Whether a compiler or ninja runs on this machine now (another build may hold a lock)."""
    import psutil

    from zeroplan.runtime.hostmem import is_build_tool

    return any(is_build_tool(p.info.get("name") or "") and p.info.get("name") != "sh" for p in psutil.process_iter(["name"]))
