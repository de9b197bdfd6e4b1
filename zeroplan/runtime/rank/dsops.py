"""DeepSpeed ops that training never calls, kept from compiling on the CPU accelerator."""

from __future__ import annotations

__all__ = [
    "OPTIMIZER_OPS", "OpLock", "build_ops", "drop_stale_locks", "extensions_env", "find_locks", "lock_report", "mark_op_loads",
    "optimizer_ops_for", "ops_without_ninja_log", "private_extensions_dir", "rank_waits_on_op_build", "ranks_in_op_load",
    "repair_ninja_logs", "skip_shm_comm_op", "unbuilt_ops", "waiting_message", "watch_op_waits",
]


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
from zeroplan.runtime.rank.dsops import skip_shm_comm_op
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

    root = Path(extensions_env()["TORCH_EXTENSIONS_DIR"])
    return tuple(b for b in builders if not (root / OPTIMIZER_OPS[b] / f"{OPTIMIZER_OPS[b]}.so").exists())


def build_ops(builders: tuple[str, ...], *, timeout_s: float = 1800.0) -> dict[str, float]:
    """JIT-compile DeepSpeed ``builders`` once, in a child process, before any probe: a probe whose
    engine compiles an op on first use spends minutes in it (DeepSpeedCPUAdam: ~110 s of CPU
    here), past a timeout derived for the plan, and a build killed half-way leaves its lock file
    behind, on which every later build waits. The build goes to zeroplan's own extensions folder
    (:func:`private_extensions_dir`), where probes load it. Returns seconds per op built (ops installed with
    DeepSpeed are skipped); RuntimeError with the build's last line when it fails."""
    import subprocess
    import sys

    env = extensions_env()
    drop_stale_locks(tuple(OPTIMIZER_OPS[b] for b in builders if b in OPTIMIZER_OPS), env=env)
    repair_ninja_logs(env=env)
    r = subprocess.run([sys.executable, "-c", _BUILD, *builders], capture_output=True, text=True, timeout=timeout_s,
                       start_new_session=True, env=env)
    if r.returncode != 0:
        last = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip()), f"exit code {r.returncode}")
        raise RuntimeError(f"building DeepSpeed's {', '.join(builders)} failed: {last}")
    return {name: float(secs) for name, secs in (ln.split() for ln in r.stdout.splitlines() if len(ln.split()) == 2)}


def user_cache_dir(env=None):
    """The user's cache folder for a process with environment ``env`` (default: this one's):
    ``$XDG_CACHE_HOME``, else ``$HOME/.cache`` — where torch puts its extensions folder and
    zeroplan its own files."""
    import os
    from pathlib import Path

    env = os.environ if env is None else env
    return Path(env.get("XDG_CACHE_HOME") or Path(env.get("HOME") or Path.home()) / ".cache")


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
    cache = user_cache_dir(env) / "torch_extensions"
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


# -- which probes wait on a build: the ranks say when they are inside an op load -------------------
#
# A probe's clock stops only while one of its own ranks is inside a JIT op load (waiting on the
# op's lock, or building it) and that op is being built. An op building in the same folder for
# another process does not stop the clock of a probe whose ranks load no op (ZeRO-0 with the
# script's torch optimizer, FSDP) or have not reached the load (a hung script): its timeout is its
# own. The ops a plan's config loads (:func:`optimizer_ops_for`) would say less: a plan that loads
# cpu_adam but hangs before ``deepspeed.initialize`` would still be paused, and a script that
# builds an op of its own (``DeepSpeedCPUAdam`` constructed by the script, another builder) would
# not.

#: The file a rank keeps in its probe folder while it is inside a JIT op load (rank number in it).
OP_LOAD_MARKER = "op-load-{rank}.json"


def mark_op_loads(result_dir, rank: int) -> None:
    """Make every JIT op load of this process say so in ``result_dir``: while
    ``torch.utils.cpp_extension.load`` runs (DeepSpeed's ``OpBuilder.jit_load`` calls it for every
    op not installed with DeepSpeed, deepspeed/ops/op_builder/builder.py; it takes
    ``<build dir>/lock``, or waits on it, and runs ninja under it: ``_jit_compile``), the file
    :data:`OP_LOAD_MARKER` holds the op's name, the lock files it waits on, this process's pid and
    host; it is removed when the load returns or raises. The launcher reads it
    (:func:`rank_waits_on_op_build`). Installing it twice in a process is a no-op."""
    import json
    import os
    import socket
    import time
    from pathlib import Path

    import torch.utils.cpp_extension as cpp_extension

    if getattr(cpp_extension.load, "_zeroplan_marks", False):
        return
    original = cpp_extension.load
    marker = Path(result_dir) / OP_LOAD_MARKER.format(rank=rank)

    def load(name, *args, **kwargs):
        build_dir = kwargs.get("build_directory")
        locks = [str(Path(build_dir) / "lock")] if build_dir else [str(lock) for lock in _lock_files([name])]
        written = False
        try:
            tmp = marker.with_name(f".{marker.name}.tmp")
            tmp.write_text(json.dumps({"op": name, "locks": locks, "pid": os.getpid(), "host": socket.gethostname(),
                                       "since": time.time()}))
            os.replace(tmp, marker)
            written = True
        except OSError:  # a folder that cannot be written: the load runs, its wait is charged
            pass
        try:
            return original(name, *args, **kwargs)
        finally:
            if written:
                marker.unlink(missing_ok=True)

    load._zeroplan_marks = True
    cpp_extension.load = load


def ranks_in_op_load(workdir, *, since_unix: float | None = None) -> list[dict]:
    """The markers (:func:`mark_op_loads`) of the ranks of the probe in ``workdir`` that are inside
    an op load now: written on this host by a process that still runs, not before ``since_unix``
    (the probe's start; a second's slack for clocks read apart)."""
    import json
    import socket

    import psutil

    host = socket.gethostname()
    out = []
    for path in sorted(_Path(workdir).glob(OP_LOAD_MARKER.format(rank="*"))):
        try:
            mark = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(mark, dict) or mark.get("host") != host or not isinstance(mark.get("pid"), int):
            continue
        if since_unix is not None and float(mark.get("since", 0.0)) < since_unix - 1.0:
            continue
        if psutil.pid_exists(mark["pid"]):
            out.append(mark)
    return out


def rank_waits_on_op_build(workdir, *, since_unix: float | None = None) -> bool:
    """Whether a rank of the probe in ``workdir`` is inside the load of an op that is being built
    now: its marker (:func:`ranks_in_op_load`) names a lock file that exists, and a compiler or
    ninja runs. That rank waits for the build (or runs it): time that is not its plan's, which the
    launcher does not charge to the probe's timeout. A rank loading no op, or waiting on a lock no
    build holds (a killed build's: it would wait for ever), is charged as usual."""
    locks = [_Path(lock) for mark in ranks_in_op_load(workdir, since_unix=since_unix) for lock in mark.get("locks") or ()]
    return any(lock.exists() for lock in locks) and _build_tools_running()


def _build_tools_running() -> bool:
    """Whether a compiler or ninja runs on this machine now (another build may hold a lock). A
    zombie (ended, not yet reaped by its parent) does not run: it builds nothing and would
    otherwise keep a killed build's lock from ever counting as stale."""
    import psutil

    from zeroplan.runtime.measure.hostmem import is_build_tool

    return any(is_build_tool(p.info.get("name") or "") and p.info.get("name") != "sh" and p.info.get("status") != psutil.STATUS_ZOMBIE
               for p in psutil.process_iter(["name", "status"]))


# -- zeroplan's own extensions folder, and what a user's shared cache holds -----------------------
#
# torch.utils.cpp_extension builds every JIT op in ``$TORCH_EXTENSIONS_DIR/<op>`` (default
# ``~/.cache/torch_extensions/<py…_accelerator>/<op>``, ``_get_build_directory``) under a lock file
# ``<op>/lock`` (``_jit_compile``: a ``FileBaton``; ``FileBaton.wait`` polls while the file exists, for
# ever). A probe rank killed at its timeout while it builds or loads an op leaves that lock behind,
# and in the shared folder every later DeepSpeed run on the machine (the user's own, which zeroplan
# never started and whose ranks do not drop stale locks) then waits on it with no message. Probes
# therefore build and load ops in a folder of zeroplan's own, one per interpreter, torch and
# DeepSpeed version *and environment*: an op's build command names the include folders of the
# torch and DeepSpeed it builds against (``torch.utils.cpp_extension.include_paths``, DeepSpeed's
# ``csrc/includes``), so two virtual environments with the same versions write different
# ``build.ninja`` files, and in one shared folder ninja rebuilt each op (~40 s of a compiler for
# ``cpu_adam`` here) whenever the other environment had loaded it last — seen in a ``.ninja_log``
# alternating between two command hashes.


def _install_tag() -> str:
    """8 hex digits naming where torch and DeepSpeed are installed and the interpreter's base (its
    C headers): what an op's build command depends on besides the versions. Found without
    importing either package (``importlib.util.find_spec`` locates a top-level package)."""
    import hashlib
    import importlib.util
    import sys

    where = []
    for name in ("torch", "deepspeed"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        where.append(str(spec.origin) if spec is not None and spec.origin else "none")
    where.append(sys.base_prefix)
    return hashlib.sha1("\0".join(where).encode()).hexdigest()[:8]


def private_extensions_dir(env=None):
    """zeroplan's own torch-extensions folder for this interpreter, torch, DeepSpeed and
    environment: ``<user cache>/zeroplan/torch_extensions/py<major><minor>_torch<version>_ds<version>_<install tag>``
    (versions from the installed packages' metadata, the tag from where they are installed,
    :func:`_install_tag`: torch is not imported)."""
    import os
    import sys
    from importlib.metadata import PackageNotFoundError, version

    env = os.environ if env is None else env

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "none"

    cache = user_cache_dir(env)
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}_torch{ver('torch')}_ds{ver('deepspeed')}_{_install_tag()}".replace("+", "-")
    return cache / "zeroplan" / "torch_extensions" / tag


def extensions_env(base=None) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``TORCH_EXTENSIONS_DIR`` set to
    :func:`private_extensions_dir`: the environment probe ranks, the warm server and the op
    pre-build run in."""
    import os

    env = dict(os.environ if base is None else base)
    env["TORCH_EXTENSIONS_DIR"] = str(private_extensions_dir(env))
    return env


def _user_cache_roots(env=None) -> list:
    """Folders whose ``<op>/lock`` a plain DeepSpeed run in ``env`` would wait on: its
    ``$TORCH_EXTENSIONS_DIR``, else every ``<user cache>/torch_extensions/<py…>`` folder."""
    import os
    from pathlib import Path

    env = os.environ if env is None else env
    if env.get("TORCH_EXTENSIONS_DIR"):
        return [Path(env["TORCH_EXTENSIONS_DIR"])]
    cache = user_cache_dir(env) / "torch_extensions"
    return sorted(p for p in cache.glob("*") if p.is_dir()) if cache.is_dir() else []


from dataclasses import dataclass  # noqa: E402
from pathlib import Path as _Path  # noqa: E402


@dataclass(frozen=True)
class OpLock:
    """A JIT op's lock file found in a torch extensions folder."""

    path: _Path
    op: str
    """The op (the lock's folder name)."""
    age_s: float
    """Seconds since the lock was taken."""
    stale: bool
    """No compiler or ninja runs on this machine and the lock is older than :data:`STALE_LOCK_AGE_S`:
    the process that took it is gone, and any load of the op waits for ever."""


def find_locks(env=None, *, roots=None) -> list[OpLock]:
    """Every ``<op>/lock`` in the user's torch extensions cache (:func:`_user_cache_roots` of
    ``env``) or in ``roots``; nothing is removed."""
    import time

    now = time.time()
    found = []
    for root in (roots if roots is not None else _user_cache_roots(env)):
        for lock in sorted(_Path(root).glob("*/lock")):
            try:
                age = now - lock.stat().st_mtime
            except OSError:
                continue
            found.append((lock, age))
    if not found:
        return []
    building = _build_tools_running()
    return [OpLock(lock, lock.parent.name, age, not building and age >= STALE_LOCK_AGE_S) for lock, age in found]


def ops_without_ninja_log(env=None, *, roots=None) -> list[str]:
    """Ops whose build folder has ``<op>.so`` but no ``.ninja_log`` (copied in, or a build whose
    log was deleted): torch's load runs ninja under the lock at every first load in a process, and
    ninja, with no log of having built the outputs, builds them again every time."""
    out = []
    for root in (roots if roots is not None else _user_cache_roots(env)):
        for so in sorted(_Path(root).glob("*/*.so")):
            if so.stem == so.parent.name and not (so.parent / ".ninja_log").exists():
                out.append(so.parent.name)
    return out


def repair_ninja_logs(env=None) -> list[str]:
    """Remove the build outputs of ops in ``env``'s extensions folder that have a ``.so`` but no
    ``.ninja_log`` (:func:`ops_without_ninja_log`), so the next load builds them once, writing the
    log, instead of rebuilding at every load. Only zeroplan's own folder is repaired; the ops removed."""
    import os

    root = (env or os.environ).get("TORCH_EXTENSIONS_DIR")
    if not root:
        return []
    repaired = []
    for op in ops_without_ninja_log(roots=[_Path(root)]):
        folder = _Path(root) / op
        if (folder / "lock").exists():
            continue
        for f in folder.iterdir():
            if f.suffix in (".so", ".o"):
                f.unlink(missing_ok=True)
        repaired.append(op)
    return repaired


def waiting_message(env=None, *, names=tuple(OPTIMIZER_OPS.values())) -> str | None:
    """One line for a probe that is waiting, when a lock in its extensions folder (``env``) explains
    it: which op, how old the lock is, whether a build is running; None when no lock is held."""
    import os

    env = os.environ if env is None else env
    root = env.get("TORCH_EXTENSIONS_DIR")
    roots = [_Path(root)] if root else _user_cache_roots(env)
    locks = [lk for lk in find_locks(roots=roots) if lk.op in names or not names]
    if not locks:
        return None
    lk = locks[0]
    if lk.stale:
        return f"waiting on DeepSpeed op {lk.op}: its lock {lk.path} is {lk.age_s:.0f} s old and no build runs (a killed build left it)"
    return f"waiting on DeepSpeed op {lk.op}: it is being built (lock {lk.path}, {lk.age_s:.0f} s)"


#: Seconds between two looks at the extensions folder while a rank's engine starts.
WAIT_WATCH_INTERVAL_S = 10.0


def watch_op_waits(*, interval_s: float = WAIT_WATCH_INTERVAL_S, write=None):
    """Start a daemon thread that, every ``interval_s`` while the caller's engine starts, prints
    :func:`waiting_message` to stderr (``zeroplan: waiting on DeepSpeed op …``) when a lock in this
    process's extensions folder explains a wait, each distinct message once; returns the function
    that stops it. A probe that waits on an op build or a killed build's lock then says so in its
    log instead of looking hung."""
    import sys
    import threading

    stop = threading.Event()
    write = write or (lambda line: print(line, file=sys.stderr, flush=True))

    def watch() -> None:
        said = set()
        while not stop.wait(interval_s):
            try:
                msg = waiting_message()
            except Exception:  # noqa: BLE001 - a look that fails says nothing; the engine goes on
                msg = None
            if msg and msg.split(" (lock")[0] not in said:
                said.add(msg.split(" (lock")[0])
                write(f"zeroplan: {msg}")

    threading.Thread(target=watch, name="zeroplan-op-wait", daemon=True).start()
    return stop.set


def lock_report(env=None) -> list[str]:
    """One line per hazard in the user's torch extensions cache (``env``'s): each lock with its age,
    whether it is stale and the ``rm`` that clears it, and each op built without a ``.ninja_log``
    (rebuilt at every load). ``zeroplan doctor`` prints them, ``zeroplan probe`` before it starts;
    nothing is removed from the user's cache."""
    notes = []
    for lk in find_locks(env):
        state = "stale: no build runs, remove it with" if lk.stale else "held by a running build; if none is running:"
        notes.append(f"{lk.op}: lock {lk.path} is {lk.age_s:.0f} s old, {state} rm {lk.path} "
                     "(every DeepSpeed run loading this op waits on it)")
    for op in ops_without_ninja_log(env):
        notes.append(f"{op}: built (.so present) but without .ninja_log, so every load of it rebuilds; delete its folder "
                     "to build it once")
    return notes
