"""A probe's clock stops for an op build only while one of its own ranks is inside that op's load.

A DeepSpeed JIT op builds under ``<extensions dir>/<op>/lock`` with ninja and a compiler running
(torch.utils.cpp_extension ``_jit_compile``). A rank inside ``torch.utils.cpp_extension.load``
keeps ``op-load-<rank>.json`` in its probe folder (``dsops.mark_op_loads``), and the launcher
stops the clock only while such a marker names a lock that exists and a build tool runs
(``dsops.rank_waits_on_op_build``). The slow test below runs real probes (warm launcher, one
rank, DeepSpeed on CPU) beside a build that is real to the code that watches it: a held lock in
the probes' extensions folder and a process named ``ninja`` running. No compiler runs: the op the
second probe loads is a copy of the one the suite built.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from zeroplan.runtime.rank import dsops


def test_a_rank_inside_an_op_load_keeps_a_marker_the_launcher_reads(tmp_path, monkeypatch):
    """``mark_op_loads`` wraps torch.utils.cpp_extension.load (what DeepSpeed's jit_load calls):
    the marker exists while the load runs, names the op's lock in the rank's extensions folder,
    and is gone when the load returns or raises; ``rank_waits_on_op_build`` is true only while
    that lock exists and a build tool runs."""
    cpp_extension = pytest.importorskip("torch.utils.cpp_extension")
    seen = []

    def load(name, *args, **kwargs):  # stands for torch's load: what the marker says meanwhile
        seen.append((dsops.ranks_in_op_load(tmp_path), dsops.rank_waits_on_op_build(tmp_path)))
        if kwargs.get("fail"):
            raise RuntimeError("Error building extension")
        return name

    monkeypatch.setattr(cpp_extension, "load", load)  # restored after the test, with the wrapper
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    lock = tmp_path / "ext" / "fused_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    building = [True]
    monkeypatch.setattr(dsops, "_build_tools_running", lambda: building[0])
    dsops.mark_op_loads(tmp_path, 3)
    dsops.mark_op_loads(tmp_path, 3)  # a second install does not wrap twice
    assert cpp_extension.load("fused_adam", sources=[]) == "fused_adam"
    (marks, waits), = seen
    assert [(m["op"], m["locks"], m["pid"]) for m in marks] == [("fused_adam", [str(lock)], os.getpid())]
    assert waits and not (tmp_path / "op-load-3.json").exists()
    with pytest.raises(RuntimeError):
        cpp_extension.load("fused_adam", fail=True)
    assert not (tmp_path / "op-load-3.json").exists()
    building[0] = False  # a lock no build holds (a killed build's): the wait is charged
    cpp_extension.load("fused_adam")
    assert seen[-1][1] is False and len(seen[-1][0]) == 1
    building[0] = True
    lock.unlink()  # the build is done: loading the .so is the plan's time
    cpp_extension.load("fused_adam")
    assert seen[-1][1] is False
    # A marker left by a process that is gone, or written before the probe started, is not a wait.
    lock.write_text("")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    import socket

    (tmp_path / "op-load-0.json").write_text(json.dumps({"op": "fused_adam", "locks": [str(lock)], "pid": int(gone),
                                                          "host": socket.gethostname(), "since": time.time()}))
    (tmp_path / "op-load-1.json").write_text(json.dumps({"op": "fused_adam", "locks": [str(lock)], "pid": os.getpid(),
                                                          "host": socket.gethostname(), "since": time.time() - 60}))
    assert not dsops.rank_waits_on_op_build(tmp_path, since_unix=time.time() - 5)
    assert dsops.rank_waits_on_op_build(tmp_path, since_unix=time.time() - 120)  # rank 1's, within the probe


# The first probe's rank loads no op: ZeRO-0 with the script's torch optimizer (no optimizer block),
# then hangs in its loop.
NO_OP_HANG = """
import time
import torch, deepspeed
model = torch.nn.Linear(8, 8)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}})
time.sleep(600)
"""

# The second's loads FusedAdam (an optimizer block on the CPU accelerator), then trains.
LOADS_FUSED_ADAM = """
import torch, deepspeed
model = torch.nn.Linear(8, 8)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
                                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
for _ in range(100):
    loss = engine(torch.randn(1, 8)).sum()
    engine.backward(loss)
    engine.step()
"""

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0}}

_LOAD_FUSED_ADAM = """
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("FusedAdamBuilder").load()
"""


def _fake_build(tmp_path: Path, seconds: float) -> subprocess.Popen:
    """A process named ``ninja`` for ``seconds`` (``sleep`` through a link of that name: its
    ``comm`` is the link's name), reaped as soon as it ends."""
    ninja = tmp_path / "bin" / "ninja"
    if not ninja.exists():
        ninja.parent.mkdir(exist_ok=True)
        ninja.symlink_to(shutil.which("sleep"))
    build = subprocess.Popen([str(ninja), str(seconds)])
    threading.Thread(target=build.wait, daemon=True).start()
    return build


def _built_fused_adam(tmp_path: Path) -> Path:
    """An extensions folder of this test's own holding FusedAdam built: a copy of the suite's
    (conftest builds it in the background; loading it here waits for that build, or builds it)."""
    shared = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    built = shared / "fused_adam"
    if not ((built / "fused_adam.so").exists() and (built / ".ninja_log").exists() and not (built / "lock").exists()):
        r = subprocess.run([sys.executable, "-c", _LOAD_FUSED_ADAM], capture_output=True, text=True, timeout=1200,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert r.returncode == 0, r.stderr[-2000:]
    ext = tmp_path / "ext"
    shutil.copytree(built, ext / "fused_adam", ignore=shutil.ignore_patterns("lock", ".ninja_lock"))
    return ext


@pytest.mark.slow
def test_only_a_probe_whose_rank_loads_the_op_being_built_has_its_clock_stopped(tmp_path):
    pytest.importorskip("deepspeed")
    from zeroplan.runtime import ProbeRequest, run_probe
    from zeroplan.runtime.launch import warm
    from zeroplan.runtime.probe import probe_environment
    from zeroplan.tuner.probetime import startup_floor_s

    ext = _built_fused_adam(tmp_path)
    env = (("TORCH_EXTENSIONS_DIR", str(ext)),)
    # The ranks' imports are the warm server's (started before any clock runs); the timeout leaves
    # room for the engine build as tests/test_runtime_faults.py's hang test does.
    timeout_s = max(10, round(4 * startup_floor_s()))
    warm.begin(probe_environment(ProbeRequest(script=tmp_path / "a.py", env=env)), log_path=tmp_path / "server.log",
               ready_timeout_s=300).wait_ready()

    # FusedAdam "is being built" in the probes' folder: its lock is held and ninja runs (for
    # longer than the first probe may take, so a clock stopped by any build would show).
    lock = ext / "fused_adam" / "lock"
    lock.write_text("")
    builds = [_fake_build(tmp_path, timeout_s + 60)]
    try:
        # 1. A probe whose rank loads no op times out on time, while the build goes on. (Its
        #    limit may end before the rank reaches its hang: the rank loads no op either way.)
        script = tmp_path / "no_op.py"
        script.write_text(textwrap.dedent(NO_OP_HANG))
        limit_s = 8
        started = time.monotonic()
        r = run_probe(ProbeRequest(script=script, ds_config=CONFIG, timeout_s=limit_s, workdir=tmp_path / "w1", env=env, steps=1,
                                   warmup=0, nproc=1))
        took = time.monotonic() - started
        assert r.status == "timeout", (r.status, r.error, r.log_tail[-2000:])
        assert "op build" not in r.waits_s and took < limit_s + 15, (took, r.waits_s)
        assert lock.exists() and builds[0].poll() is None  # the build was on all along
        builds[0].kill()

        # 2. A probe whose rank loads FusedAdam waits on the build past its timeout, is not
        #    killed, and its wait is recorded as not the plan's. The build "ends" 3 s after the
        #    probe's limit, the rank having been inside the load since before it.
        builds.append(_fake_build(tmp_path, 600))
        script = tmp_path / "fused.py"
        script.write_text(textwrap.dedent(LOADS_FUSED_ADAM))
        workdir = tmp_path / "w2"
        entered: list[float] = []

        def finish_build() -> None:
            while not list(workdir.glob("op-load-*.json")) and time.monotonic() < started + timeout_s + 3:
                time.sleep(0.05)
            entered.append(time.monotonic())
            time.sleep(max(started + timeout_s + 3 - time.monotonic(), 0))
            lock.unlink(missing_ok=True)
            builds[-1].kill()

        started = time.monotonic()
        builder = threading.Thread(target=finish_build, daemon=True)
        builder.start()
        r = run_probe(ProbeRequest(script=script, ds_config=CONFIG, timeout_s=timeout_s, workdir=workdir, env=env, steps=1, warmup=0,
                                   nproc=1))
        took = time.monotonic() - started
        builder.join(timeout=60)
        assert entered and entered[0] < started + timeout_s, "the rank did not reach the op's load within the probe's limit"
        assert r.status == "ok", (r.status, r.error, r.log_tail[-2000:])
        assert took > timeout_s + 3  # it ran past its limit, waiting on the build
        # The wait is recorded as not the plan's: about the time the rank spent inside the load
        # (checked once a second), which is more than what was left of its limit.
        in_load = started + timeout_s + 3 - entered[0]
        assert in_load - 3 <= r.waits_s.get("op build", 0.0) <= in_load + 2, (r.waits_s, in_load)
        assert not list(workdir.glob("op-load-*.json"))  # the rank's load returned
    finally:
        for build in builds:
            build.kill()
            build.wait()
        lock.unlink(missing_ok=True)


def test_a_zombie_compiler_is_not_a_build(monkeypatch):
    """A compiler or ninja that has ended but was not reaped (a zombie) builds nothing: it stops no
    probe's clock and does not keep a killed build's lock from counting as stale."""
    import psutil

    class Proc:
        def __init__(self, name, status):
            self.info = {"name": name, "status": status}

    procs = [Proc("python3", psutil.STATUS_RUNNING), Proc("ninja", psutil.STATUS_ZOMBIE), Proc("cc1plus", psutil.STATUS_ZOMBIE)]
    monkeypatch.setattr(psutil, "process_iter", lambda attrs=None: iter(procs))
    assert not dsops._build_tools_running()
    procs.append(Proc("cc1plus", psutil.STATUS_RUNNING))
    assert dsops._build_tools_running()
