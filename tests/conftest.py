"""Test-session environment: on a machine without CUDA, DeepSpeed runs on its CPU accelerator
(as `zeroplan probe` arranges for its own workers), so `python -m pytest` needs nothing set."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys

import pytest

from helpers import ROOT, run_zeroplan


def _no_cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return True
    try:
        import torch
    except ImportError:
        return True
    return not torch.cuda.is_available()


if _no_cuda():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Every engine the tests start — a probe's ranks, a plain torchrun child, an engine built in this
# process — loads DeepSpeed's JIT ops from the one folder zeroplan's probes use
# (zeroplan.runtime.rank.dsops.private_extensions_dir), so a fresh machine compiles each op once (about
# four minutes of CPU for the two), not once for that folder and again for the default cache.
if "TORCH_EXTENSIONS_DIR" not in os.environ:
    from zeroplan.runtime.rank.dsops import private_extensions_dir

    os.environ["TORCH_EXTENSIONS_DIR"] = str(private_extensions_dir())

# A shell starts background jobs (`cmd &`, as some CI runners and nohup wrappers do) with SIGINT
# ignored, and an ignored signal stays ignored across exec: every zeroplan process the tests start
# would then shrug off the Ctrl-C that the interrupt tests send. A handled signal is reset to its
# default at exec, so handling it here gives the children Ctrl-C as a terminal would.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


#: Builds DeepSpeed's CPU optimizer ops into the tests' extensions folder (above), lowest CPU
#: priority, in its own session (a Ctrl-C to the tests never stops a compile half-way and leaves
#: its lock behind).
_BUILD_OPS = """
import os
os.nice(19)
from deepspeed.accelerator import get_accelerator
if get_accelerator()._name == "cpu":
    for name in ("FusedAdamBuilder", "CPUAdamBuilder"):
        get_accelerator().create_op_builder(name).load()
"""


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: only the tests that will run count
def pytest_collection_modifyitems(config, items):
    """Run the ``slow`` tests (real engines) after the others, and meanwhile build the DeepSpeed ops
    they load in the background.

    On a fresh machine DeepSpeed JIT-compiles its CPU optimizer ops on first use: FusedAdam (an
    optimizer block on the CPU accelerator) and DeepSpeedCPUAdam (optimizer offload), each a
    compile of ``csrc/adam/cpu_adam_impl.cpp`` — about two minutes of CPU apiece, which the first
    engine test used to wait for. The quick tests mostly keep one core busy; the build, at the
    lowest priority, takes the other. An engine that needs an op still being built waits on the
    build's lock (torch.utils.cpp_extension), as it would for another rank's build; a built op is
    only loaded. The sort is stable: each group keeps the collection order.
    """
    items.sort(key=lambda item: item.get_closest_marker("slow") is not None)
    if config.option.collectonly or os.environ.get("DS_ACCELERATOR") != "cpu":
        return
    if not any(item.get_closest_marker("slow") for item in items):
        return
    if importlib.util.find_spec("deepspeed") is None:
        return
    subprocess.Popen([sys.executable, "-c", _BUILD_OPS], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.fixture(scope="session")
def repo_root():
    """The repository root (tests/helpers.py ROOT)."""
    return ROOT


@pytest.fixture(scope="session")
def zeroplan_cli():
    """Runs ``python -m zeroplan ARGS`` from the repository root: :func:`helpers.run_zeroplan`."""
    return run_zeroplan


@pytest.fixture(scope="session")
def warm_server():
    """Probes and tunes run in this process (``run_probe``, or ``helpers.run_main(["probe" | "tune",
    ...])``) share zeroplan's warm launcher server, as a tune's trials do: it imports torch,
    DeepSpeed and transformers once (seconds of CPU) instead of once per ``python -m zeroplan``
    child, which also paid torch's import itself. A probe with another environment replaces it
    (zeroplan.runtime.launch.warm.begin). Stopped and reaped when the session ends."""
    yield
    from zeroplan.runtime.launch import warm

    warm.shutdown()


@pytest.fixture
def zeroplan_here(capsys, monkeypatch, warm_server):
    """Runs ``zeroplan ARGS`` through the console-script entry point in this process, from the
    repository root with DeepSpeed on CPU, as :func:`helpers.run_zeroplan`'s child would (its
    exit code and output as a ``CompletedProcess``); its probes use the session's warm server."""
    import subprocess

    from helpers import run_main

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")

    def run(*args: str) -> subprocess.CompletedProcess:
        code, out, err = run_main(list(args), capsys)
        return subprocess.CompletedProcess(["zeroplan", *args], code, out, err)

    return run


@pytest.fixture(scope="session")
def optimizer_step_rows():
    """benchmarks/optimizer_step_memory.py on 2 gloo ranks, every (stage, impl) the tests check
    measured in one launch (each run has its own tracker; the rows equal separate launches'):
    ``{(stage, impl): row}``. Two steps: the second is the first after the optimizer's lazily
    created state, and its bytes equal the benchmark's default third step's (row for row)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    root = ROOT
    runs = ((2, "torch-loop"), (3, "config"))
    env = {**os.environ, "PYTHONPATH": str(root), "DS_ACCELERATOR": "cpu"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(root / "benchmarks" / "optimizer_step_memory.py"), "--runs", ",".join(f"{s}:{i}" for s, i in runs), "--steps", "2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert [(row["stage"], row["impl"]) for row in rows] == list(runs)
    return {(row["stage"], row["impl"]): row for row in rows}
