"""Faulty scripts give the right status, a readable reason, and leave no process behind.

Each test launches a real 2-process torchrun job (DeepSpeed imported on CPU), hence ``slow``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from zeroplan.runtime import ProbeRequest, run_probe

pytestmark = pytest.mark.slow

from helpers import ROOT
CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 0}}

# Writes "<worker pid> <grandchild pid>" so the test can check that both are gone.
HANG = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.path.join(os.environ["ZEROPLAN_TEST_PID_DIR"], f"pid-{os.getpid()}"), "w").write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


def _probe(tmp_path: Path, source: str, *, timeout_s: float = 300, **kw):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return run_probe(ProbeRequest(script=script, ds_config=CONFIG, timeout_s=timeout_s, workdir=tmp_path / "w", **kw))


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _recorded_pids(pid_dir: Path) -> list[int]:
    return [int(p) for f in pid_dir.glob("pid-*") for p in f.read_text().split()]


def test_raises_at_import(tmp_path):
    r = _probe(tmp_path, "import zeroplan_no_such_module_anywhere\n")
    assert r.status == "error"
    assert "ModuleNotFoundError" in r.error and "zeroplan_no_such_module_anywhere" in r.error
    assert "Traceback" in r.log_tail


@pytest.mark.e2e  # the same probe runs in test_dsconfig_plan.py::test_cli_probe_estimates_a_stage_2_config_with_offload_param
def test_never_calls_deepspeed_initialize(tmp_path):
    r = _probe(tmp_path, """
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--deepspeed_config")
        print("config at", parser.parse_args().deepspeed_config)
    """)
    assert r.status == "error" and "without calling deepspeed.initialize" in r.error
    assert "config at" in r.log_tail and "ds_config.json" in r.log_tail  # the config reached the script


def test_sys_exit_3(tmp_path):
    r = _probe(tmp_path, "import sys\nsys.exit(3)\n")
    assert r.status == "error" and "sys.exit(3)" in r.error


def test_allocation_past_memory_is_oom(tmp_path):
    # 64 TiB: refused by the allocator at once (no real memory pressure on the test machine).
    r = _probe(tmp_path, "import torch\nx = torch.empty(1 << 46, dtype=torch.uint8)\n")
    assert r.status == "oom", r.error
    assert "allocate" in r.error and r.memory_limit == "host"


def test_memory_error_under_rlimit_is_oom(tmp_path):
    r = _probe(tmp_path, """
        import resource
        # Address-space limit just above what is mapped now, then a 16 GiB buffer: MemoryError.
        import psutil
        limit = psutil.Process().memory_info().vms + (1 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
        hog = bytearray(16 << 30)
    """)
    assert r.status == "oom", r.error
    assert "MemoryError" in r.error and r.memory_limit == "host"


def test_hang_times_out_and_leaves_no_process(tmp_path):
    from zeroplan.tuner.probetime import startup_floor_s

    # The ranks must be running the script (and have spawned their grandchildren) before the
    # timeout: they start after torchrun and each imports torch and DeepSpeed, which measured
    # 2.2× this machine's bare `import torch` (25 s against 11.5 s on a loaded 2-core box). Four
    # times it, at least 10 s, leaves room without waiting a fixed 25 s on a fast machine.
    # The pid folder travels in a ZEROPLAN_ variable, read at run time, so one warm server serves
    # every probe of these tests; it is started (if no earlier test did) before the clock runs.
    from zeroplan.runtime.launch import warm
    from zeroplan.runtime.probe import probe_environment

    timeout_s = max(10, round(4 * startup_floor_s()))
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    env = (("ZEROPLAN_TEST_PID_DIR", str(pid_dir)),)
    warm.begin(probe_environment(ProbeRequest(script=tmp_path / "script.py", env=env)), log_path=tmp_path / "server.log",
               ready_timeout_s=300).wait_ready()
    started = time.monotonic()
    r = _probe(tmp_path, HANG, timeout_s=timeout_s, env=env)
    assert r.status == "timeout" and f"{timeout_s} s" in r.error
    assert time.monotonic() - started < timeout_s + 15  # killed within the grace period
    pids = _recorded_pids(pid_dir)
    assert len(pids) == 4, pids  # 2 workers, each with a grandchild
    assert not [p for p in pids if _alive(p)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_killing_the_caller_kills_the_whole_job(tmp_path, sig):
    """Ctrl-C (or even SIGKILL) to the process running run_probe: the job dies with it."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from zeroplan.runtime import ProbeRequest, run_probe
        try:
            run_probe(ProbeRequest(script=Path({str(script)!r}), ds_config={CONFIG!r}, timeout_s=120,
                                   workdir=Path({str(tmp_path / 'w')!r}), env=(("ZEROPLAN_TEST_PID_DIR", {str(pid_dir)!r}),)))
        except KeyboardInterrupt:
            print("interrupted")
    """))
    proc = subprocess.Popen([sys.executable, str(driver)], env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while len(list(pid_dir.glob("pid-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    pids = _recorded_pids(pid_dir)
    assert len(pids) == 4
    if sig == signal.SIGINT:
        assert "interrupted" in out
    else:  # nobody is left to clean up: torchrun's and the workers' parent-death signals do it
        deadline = time.monotonic() + 20
        while [p for p in pids if _alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
    assert not [p for p in pids if _alive(p)]
