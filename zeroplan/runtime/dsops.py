"""DeepSpeed ops that training never calls, kept from compiling on the CPU accelerator."""

from __future__ import annotations

__all__ = ["OPTIMIZER_OPS", "build_ops", "drop_stale_locks", "optimizer_ops_for", "skip_shm_comm_op", "unbuilt_ops"]


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

    drop_stale_locks(tuple(OPTIMIZER_OPS[b] for b in builders if b in OPTIMIZER_OPS))
    r = subprocess.run([sys.executable, "-c", _BUILD, *builders], capture_output=True, text=True, timeout=timeout_s,
                       start_new_session=True)
    if r.returncode != 0:
        last = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip()), f"exit code {r.returncode}")
        raise RuntimeError(f"building DeepSpeed's {', '.join(builders)} failed: {last}")
    return {name: float(secs) for name, secs in (ln.split() for ln in r.stdout.splitlines() if len(ln.split()) == 2)}


def _lock_files(names, env=None) -> list:
    """``<build dir>/lock`` of each op in ``names``, where torch.utils.cpp_extension
    ``_get_build_directory`` puts it for a process with environment ``env`` (default: this one's):
    ``$TORCH_EXTENSIONS_DIR/<name>``, else ``<user cache>/torch_extensions/<py…_accelerator>/<name>``
    (found without importing torch)."""
    import os
    from pathlib import Path

    env = os.environ if env is None else env
    root = env.get("TORCH_EXTENSIONS_DIR")
    if root:
        return [Path(root) / name / "lock" for name in names]
    cache = Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache") / "torch_extensions"
    return [lock for name in names for lock in cache.glob(f"*/{name}/lock")]


def drop_stale_locks(names=tuple(OPTIMIZER_OPS.values()), *, env=None, since: float | None = None) -> list[str]:
    """Remove the lock files killed processes left on DeepSpeed's optimizer ops ``names`` in torch's
    extensions cache; the ops whose lock was removed.

    torch.utils.cpp_extension ``_jit_compile`` takes ``<build dir>/lock`` (a ``FileBaton``) at every
    first load of an op in a process, even an op already built: it runs ninja's up-to-date check
    under it. A process killed meanwhile (a rank stopped at a probe's timeout, a build interrupted)
    leaves the lock, and every later load of that op, in any process, waits on it for ever
    (``FileBaton.wait`` polls while the file exists). A lock is such a leftover when no build tool
    runs on this machine and it is older than :data:`STALE_LOCK_AGE_S` (a live holder writes
    build.ninja and starts ninja within moments of taking it), or was taken after ``since`` (a
    probe's start, once every process of that probe has been killed)."""
    import time

    now = time.time()
    stale = []
    for lock in _lock_files(names, env):
        try:
            taken = lock.stat().st_mtime
        except OSError:
            continue
        if now - taken >= STALE_LOCK_AGE_S or (since is not None and taken >= since):
            stale.append(lock)
    if not stale or _build_tools_running():
        return []
    for lock in stale:
        lock.unlink(missing_ok=True)
    return [lock.parent.name for lock in stale]


def held_locks(names=tuple(OPTIMIZER_OPS.values()), *, env=None) -> list[str]:
    """The ops among ``names`` whose build directory holds a lock now (loading one would wait)."""
    return [lock.parent.name for lock in _lock_files(names, env) if lock.exists()]


def op_build_in_progress(names=tuple(OPTIMIZER_OPS.values()), *, env=None) -> bool:
    """Whether one of DeepSpeed's ops ``names`` is being compiled now: its build directory holds a
    lock (:func:`held_locks`) and a compiler or ninja runs. A rank loading the op meanwhile waits
    for that build (torch.utils.cpp_extension ``_jit_compile``'s ``FileBaton``): time that is not
    its plan's (the launcher does not charge it to the probe's timeout)."""
    return bool(held_locks(names, env=env)) and _build_tools_running()


def _build_tools_running() -> bool:
    """Whether a compiler or ninja runs on this machine now (another build may hold a lock)."""
    import psutil

    from zeroplan.runtime.hostmem import is_build_tool

    return any(is_build_tool(p.info.get("name") or "") and p.info.get("name") != "sh" for p in psutil.process_iter(["name"]))
