"""The warm launcher's server: one process that imported torch, DeepSpeed and the probe worker once,
and forks each probe's ranks from that state (``python -m zeroplan.runtime.launch.warm_server FD``).

Why it is safe to fork here: nothing in this process has run a parallel torch op (no OpenMP pool)
or touched a GPU. On a machine with NVIDIA devices the check is NVML's (``torch.cuda.device_count``
does not initialise CUDA) and DeepSpeed is told ``DS_ACCELERATOR=cuda`` so its accelerator
detection does not call ``torch.cuda.is_available`` (``cudaGetDeviceCount`` initialises the
driver, and a forked child of a process whose driver is initialised cannot use CUDA). After the
imports the server checks that the CUDA driver library is not mapped and refuses to serve
otherwise; the launcher then uses torchrun. torch's own fork handlers (as for ``DataLoader``
workers) and OpenBLAS's reset their thread pools in each child.

Protocol over a ``SOCK_SEQPACKET`` Unix socket (one JSON object per message):

* server → launcher once: ``{"ready": true, "pid": P}`` or ``{"ready": false, "error": "..."}``;
* launcher → server: ``{"spec": PROBE_JSON, "nproc": N, "cwd": DIR, "env": {...}, "master_port": PORT}``
  with one file descriptor attached (the write end of the probe's output pipe); or ``{"later": true}``:
  take every :func:`later_work` step now (nothing of the caller's runs that it would disturb);
* server → launcher: ``{"leader": PID}``, the probe's leader process; later ``{"exit": PID, "code": C}``.

A leader is what ``torchrun --standalone`` is to its workers: its own session (the launcher kills
the probe's process groups on timeout or Ctrl-C), one forked child per rank with the environment
torchrun gives (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT ...), all output to the pipe; when a
rank fails it stops the others and prints the failure as torchrun does (``exitcode : -9`` for a
rank killed by SIGKILL, which the classifier reads as the kernel's OOM killer), exit code 1.
When the launcher's process ends (the socket closes) the server kills every leader's group and exits.
"""

from __future__ import annotations

import copy
import json
import os
import select
import signal
import socket
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Iterator

__all__ = ["main", "KILL_GRACE_S"]

#: Seconds between SIGTERM and SIGKILL when a leader stops the ranks of a failed probe (torchrun's own default is 30).
KILL_GRACE_S = 5.0
#: Seconds between checks for exited leaders.
POLL_S = 0.05


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _prctl_death_signal(sig: int) -> None:
    if sys.platform != "linux":
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _cuda_driver_loaded() -> bool:
    """The CUDA driver library is mapped into this process (a forked child could not use the GPU)."""
    try:
        with open("/proc/self/maps") as fh:
            return any("libcuda.so" in line for line in fh)
    except OSError:
        return False


#: What every probe rank imports before the user's script runs (torch first, then DeepSpeed on the
#: accelerator the worker itself would pick): the server is ready once these are imported.
BASE_MODULES = (
    "deepspeed",
    "deepspeed.comm",
    "zeroplan.runtime.measure.classify",
    "zeroplan.runtime.measure.hostmem",
    "zeroplan.runtime.measure.memory",
    "zeroplan.runtime.measure.steptime",
    "zeroplan.runtime.rank.worker",
)
#: What a DeepSpeed rank imports later, on its way to the first step (measured with cProfile in a
#: rank: torch._dynamo ~2 s here — the worker's memory tracker imports it — and DeepSpeed's
#: optimizer check imports its Muon optimizer, whose ``torch.compile`` pulls in inductor). Loaded
#: only while no probe runs, after the first probe (so a single probe never waits for them).
LATER_MODULES = (
    "torch._dynamo",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.stage3",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.ops.adam",
    "zeroplan.runtime.rank.backends.deepspeed",
    "zeroplan.runtime.rank.backends.fsdp",
)
#: DeepSpeed's CPU ops its engine loads (communication, the fused and the offloaded Adam): loading
#: one runs py-cpuinfo in a subprocess and ninja's up-to-date check, ~1.5 s each; DeepSpeed keeps a
#: loaded op (``OpBuilder._loaded_ops``), so ranks forked after it find it loaded. Only ops already
#: built are loaded (the server never compiles), and only on the CPU accelerator.
LATER_CPU_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder", "CPUAdamBuilder")


def _import(name: str) -> None:
    import importlib

    try:
        importlib.import_module(name)
    except ImportError:
        pass  # an older DeepSpeed, or none (FSDP probes): the ranks import what exists


def _preload() -> None:
    """torch, then DeepSpeed on the accelerator the worker would pick (no GPU: its CPU accelerator),
    then the worker and what it uses."""
    import torch

    on_gpu = torch.cuda.device_count() > 0  # NVML: no CUDA initialisation
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if on_gpu else "cpu")
    for name in BASE_MODULES:
        _import(name)


def _load_built_cpu_op(name: str) -> None:
    if os.environ.get("DS_ACCELERATOR") != "cpu" or "deepspeed" not in sys.modules:
        return
    try:
        from torch.utils.cpp_extension import _get_build_directory

        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder(name)
        if builder is None:
            return
        folder = _get_build_directory(builder.name, verbose=False)
        # Never wait on a lock (torch's FileBaton would, for ever, on one a killed rank left): the
        # server must stay free to fork the next probe; a rank loads the op itself then.
        if os.path.exists(os.path.join(folder, f"{builder.name}.so")) and not os.path.exists(os.path.join(folder, "lock")):
            with _cpu_info_asked_once():
                builder.load(verbose=False)
    except Exception:  # noqa: BLE001 - a rank loads (or builds) it itself, as under torchrun
        return


#: py-cpuinfo's answer, once the server has asked (:func:`_cpu_info_asked_once`).
_CPU_INFO: dict = {}


@contextmanager
def _cpu_info_asked_once() -> Iterator[None]:
    """While the server loads DeepSpeed's ops, py-cpuinfo's ``get_cpu_info`` runs once: each call
    starts a fresh interpreter (measured here: 1.7 s of wall time at load 12), and DeepSpeed's op
    builder asks it twice per op load (``OpBuilder.cpu_arch`` and ``simd_width``, for the compile
    flags), so loading FusedAdam and CPUAdam took 3.7 s each, nearly all of it waiting. The same
    machine answers the same; the library's own function is put back after each load, so the ranks
    forked later run py-cpuinfo as installed."""
    try:
        import cpuinfo
    except ImportError:
        yield
        return
    original = cpuinfo.get_cpu_info

    def asked_once() -> dict:
        if "info" not in _CPU_INFO:
            _CPU_INFO["info"] = original()
        return copy.deepcopy(_CPU_INFO["info"])

    cpuinfo.get_cpu_info = asked_once
    try:
        yield
    finally:
        cpuinfo.get_cpu_info = original


def later_work() -> list:
    """The steps the server takes while idle after its first probe, in order (each ≤ a few seconds),
    as (name, step). None on a GPU machine: whether an import there initialises CUDA is not checked
    step by step."""
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        return []
    steps = [(name, lambda name=name: _import(name)) for name in LATER_MODULES]
    steps += [(name, lambda name=name: _load_built_cpu_op(name)) for name in LATER_CPU_OPS]
    return steps


def _take(later: list) -> None:
    """Take the next :func:`later_work` step; its wall and CPU seconds go to the server's log (a
    probe that waited for the server waited for such a step)."""
    name, step = later.pop(0)
    wall, cpu = time.monotonic(), time.process_time()
    step()
    print(f"zeroplan warm server: {name} {time.monotonic() - wall:.2f} s (CPU {time.process_time() - cpu:.2f} s)", flush=True)


def _rank_env(rank: int, nproc: int, master_port: int, run_id: str) -> dict[str, str]:
    """The variables ``torchrun --standalone`` gives each worker (torch/distributed/elastic/agent/server/
    local_elastic_agent.py ``_start_workers``), less the agent store: rank 0 hosts the TCPStore itself."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
    }


def _run_rank(spec: str, env: dict[str, str]) -> None:
    """In a rank's process: its environment, fresh random state, the worker. Never returns."""
    os.environ.update(env)
    import random

    random.seed()  # a forked child inherits the server's state; a fresh interpreter draws its own
    code = 1
    try:
        from zeroplan.runtime.rank.worker import main

        sys.argv = [sys.argv[0], spec]
        code = main([spec])  # the worker ends with os._exit; this is for a worker that returns
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - report it like a crashed interpreter would
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _describe(status: int) -> tuple[int, str]:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return code, f"Signal {-code} ({name}) received"
    return code, f"exit code {code}"


def _lead(request: dict, out_fd: int, sock: socket.socket) -> None:
    """In the leader's process: start every rank, wait, stop the rest when one fails. Never returns."""
    sock.close()
    os.setsid()
    _prctl_death_signal(signal.SIGTERM)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()  # exactly the probe's environment, as torchrun's workers get it
    os.environ.update(request.get("env") or {})
    os.chdir(request["cwd"])
    nproc = int(request["nproc"])
    run_id = f"zeroplan-warm-{os.getpid()}"
    ranks: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
            _run_rank(request["spec"], _rank_env(rank, nproc, int(request["master_port"]), run_id))
        ranks[pid] = rank

    def stop(signum, _frame) -> None:
        # The whole probe: the ranks and whatever they started in this session (torchrun kills
        # its workers' process groups the same way).
        signal.signal(signum, signal.SIG_IGN)
        try:
            os.killpg(0, signum)
        except OSError:
            pass
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failed: tuple[int, int, int, str] | None = None
    left = dict(ranks)
    deadline: float | None = None
    while left:
        if deadline is None:
            pid, status = os.wait()
        else:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() >= deadline:
                    for other in left:
                        try:
                            os.kill(other, signal.SIGKILL)
                        except OSError:
                            pass
                    deadline = time.monotonic() + 3600
                time.sleep(0.05)
                continue
        rank = left.pop(pid, None)
        if rank is None:
            continue
        code, how = _describe(status)
        if code != 0 and failed is None:
            failed = (rank, pid, code, how)
            for other in left:
                try:
                    os.kill(other, signal.SIGTERM)
                except OSError:
                    pass
            deadline = time.monotonic() + KILL_GRACE_S
    if failed is None:
        os._exit(0)
    rank, pid, code, how = failed
    # torchrun's summary (torch/distributed/elastic/multiprocessing/errors ChildFailedError) in a
    # form the classifier reads: "exitcode : -9" marks a rank killed by SIGKILL.
    print(f"zeroplan warm launcher: rank {rank} (local_rank: {rank}) failed, pid {pid}, exitcode : {code} ({how})", flush=True)
    os._exit(1)


def serve(sock: socket.socket) -> int:
    """Fork a leader per request until the launcher's end of the socket closes; between probes,
    after the first, take the :func:`later_work` steps one at a time."""
    leaders: set[int] = set()
    later = later_work()
    served = 0
    while True:
        for pid in list(leaders):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                leaders.discard(pid)
                _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        readable, _, _ = select.select([sock], [], [], 0 if (later and served and not leaders) else POLL_S)
        if not readable:
            if later and served and not leaders:
                _take(later)  # never while a probe runs: it would share the probe's cores
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 4)
        except OSError:
            data, fds = b"", []
        if not data:
            for pid in leaders:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            # At once: the teardown of an interpreter holding torch, DeepSpeed and dynamo takes
            # seconds, and the caller that went away expects its probe processes gone.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        request = json.loads(data)
        if request.get("later"):
            # The caller has nothing running that this would disturb (zeroplan tune, before its
            # first probe). A request or the caller's exit arriving meanwhile comes first; the steps
            # left are then taken between probes.
            while later and not select.select([sock], [], [], 0)[0]:
                _take(later)
            continue
        if not fds:
            _send(sock, {"error": "no output pipe attached"})
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _lead(request, fds[0], sock)
            finally:
                os._exit(1)
        for fd in fds:
            os.close(fd)
        leaders.add(pid)
        served += 1
        _send(sock, {"leader": pid})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    started = time.monotonic()
    try:
        _preload()
    except BaseException as exc:  # noqa: BLE001 - the launcher falls back to torchrun and says why
        _send(sock, {"ready": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]})
        return 1
    if _cuda_driver_loaded():
        _send(sock, {"ready": False, "error": "the CUDA driver was loaded while importing torch/DeepSpeed; forked ranks could not use the GPU"})
        return 1
    _send(sock, {"ready": True, "pid": os.getpid(), "import_s": time.monotonic() - started})
    return serve(sock)


if __name__ == "__main__":
    sys.exit(main())
