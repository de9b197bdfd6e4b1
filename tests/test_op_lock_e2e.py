"""A probe killed while DeepSpeed's op builds leaves no lock where a plain DeepSpeed run waits.

torch.utils.cpp_extension builds a JIT op under ``<extensions dir>/<op>/lock`` and every other
process loading that op waits while the file exists (``FileBaton.wait``). Probes build in
zeroplan's own folder (``dsops.private_extensions_dir``), so killing one mid-build must not leave
a lock in the folder a user's own ``deepspeed`` run uses. This compiles FusedAdam's CPU kernel once
(about two minutes of CPU): one test, slow and end-to-end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
pytest.importorskip("deepspeed")

from helpers import ROOT  # noqa: E402  (after the module's skip marks)

# A probe whose engine builds FusedAdam (an optimizer block on the CPU accelerator) at deepspeed.initialize.
SCRIPT = """
import torch, deepspeed
model = torch.nn.Linear(8, 8)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                  config={"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
"""

DRIVER = """
import sys
from pathlib import Path
from zeroplan.runtime import ProbeRequest, run_probe
run_probe(ProbeRequest(script=Path(sys.argv[1]), ds_config={{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": 0}},
                       "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}}}}, nproc=1, timeout_s=1200, workdir=Path(sys.argv[2])))
"""

# What a user's own run does: no zeroplan, the default extensions folder, FusedAdam loaded.
PLAIN = """
import time
from deepspeed.accelerator import get_accelerator
start = time.monotonic()
get_accelerator().create_op_builder("FusedAdamBuilder").load()
print("loaded", round(time.monotonic() - start, 1), flush=True)
"""


def test_probe_killed_mid_build_leaves_no_lock_for_a_plain_deepspeed_run(tmp_path):
    from zeroplan.runtime.rank.dsops import private_extensions_dir

    cache = tmp_path / "cache"  # a fresh user cache: nothing built yet, so the probe must build
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
    env.pop("TORCH_EXTENSIONS_DIR", None)
    private = private_extensions_dir(env)
    user_root = cache / "torch_extensions"
    (tmp_path / "script.py").write_text(textwrap.dedent(SCRIPT))
    (tmp_path / "driver.py").write_text(textwrap.dedent(DRIVER.format()))
    driver = subprocess.Popen([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "script.py"), str(tmp_path / "w")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lock = private / "fused_adam" / "lock"
    deadline = time.monotonic() + 600
    while not lock.exists() and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.5)
    assert lock.exists(), "the probe never started building FusedAdam in zeroplan's folder"
    time.sleep(3)  # the compiler is running
    os.killpg(driver.pid, signal.SIGKILL)  # the probe and everything it started, mid-build
    driver.wait(timeout=30)
    time.sleep(2)
    assert lock.exists()  # the killed build's lock is left, in zeroplan's own folder
    assert not user_root.exists() or not list(user_root.glob("*/*/lock"))
    # A plain DeepSpeed run in the user's default folder loads (builds) the op without waiting on it.
    r = subprocess.run([sys.executable, "-c", PLAIN], env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0 and "loaded" in r.stdout, r.stderr[-2000:]
    assert list(user_root.glob("*/fused_adam/fused_adam.so"))
