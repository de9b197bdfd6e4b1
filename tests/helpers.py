"""What several test files share: the repository's paths, running ``zeroplan`` (as a process or
through its entry point in this process), loading an example or benchmark script by path, and
the tuner's replayed probes.

Tests import from here (``from helpers import ROOT, run_zeroplan``; pytest puts ``tests/`` on the
import path as the folder of the root conftest) or take the fixtures ``repo_root`` and
``zeroplan_cli`` that tests/conftest.py builds on it. No test edits ``sys.path`` and none imports
another test module.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Optional

__all__ = [
    "BENCHMARKS", "EXAMPLES", "GPT_TASK", "ROOT", "Replay", "benchmark", "example", "make_space", "run_main", "run_zeroplan",
    "zeroplan_env",
]

#: The repository root (the folder holding pyproject.toml).
ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BENCHMARKS = ROOT / "benchmarks"


def zeroplan_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (the code under test)."""
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def run_zeroplan(
    *args: str, cwd: Optional[Path] = None, timeout: float = 120, columns: Optional[int] = None, env: Optional[dict] = None,
) -> subprocess.CompletedProcess:
    """``python -m zeroplan ARGS`` as a child process from the repository root (text output captured).

    ``columns`` sets the terminal width rich renders tables for; ``env`` replaces
    :func:`zeroplan_env` entirely.
    """
    if env is None:
        env = zeroplan_env(**({"COLUMNS": str(columns)} if columns else {}))
    return subprocess.run(
        [sys.executable, "-m", "zeroplan", *args], capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=timeout,
    )


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run ``zeroplan`` in this process through ``main()`` (the console-script entry point):
    (exit code, stdout, stderr), read with pytest's ``capsys``."""
    from zeroplan.cli import main

    old = sys.argv
    sys.argv = ["zeroplan", *argv]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = old
    out, err = capsys.readouterr()
    return code, out, err


def _load(path: Path) -> ModuleType:
    """Import the script at ``path`` as the module of its file name, once per session: later
    ``import NAME`` statements (in tests or in the examples themselves) get the same module."""
    name = path.stem
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def example(name: str) -> ModuleType:
    """``examples/NAME.py`` as module ``NAME``."""
    return _load(EXAMPLES / f"{name}.py")


def benchmark(name: str) -> ModuleType:
    """``benchmarks/NAME.py`` as module ``NAME``."""
    return _load(BENCHMARKS / f"{name}.py")


# -- the tuner's bookkeeping without probes (test_tuner_search, test_tuner_ledger, test_tuner_failures,
#    test_shared_study's worker processes) -------------------------------------------------------------

def _gpt_task_spec():
    from zeroplan.spec import ModelSpec

    return ModelSpec(
        name="gpt_task", params=136_960, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
        ffn_size=256, vocab_size=512,
    )


#: examples/gpt_task.py's default model as the estimator sees it.
GPT_TASK = _gpt_task_spec()


def make_space(global_batch: int = 16):
    """The tuner's search space for GPT_TASK on 2 CPU ranks."""
    from zeroplan.profiles import resolve_cluster
    from zeroplan.spec import TrainingSpec
    from zeroplan.tuner import build_space

    cluster = resolve_cluster(gpus=2, gpus_per_node=None, gpu="a100-80gb", gpu_memory_gib=None, cpu_memory_gib=64, nvme_gib=None)
    return build_space(GPT_TASK, cluster, TrainingSpec(seq_len=64, global_batch=global_batch), device="cpu")


class Replay:
    """Outcomes by rule: oom for z0 at micro-batch >= 4, else a throughput growing with micro-batch."""

    def __init__(self, oom_from: int | None = 4, crash_keys: tuple[str, ...] = ()):
        self.calls: list = []
        self.oom_from = oom_from
        self.crash_keys = crash_keys

    def __call__(self, plan, *, trial_number: int, on_line=None):
        from zeroplan.tuner import ProbeOutcome, plan_key

        self.calls.append(plan)
        if plan_key(plan) in self.crash_keys:
            raise RuntimeError("runner exploded")
        if self.oom_from is not None and plan.stage == 0 and plan.micro_batch >= self.oom_from:
            return ProbeOutcome(status="oom", error="CUDA out of memory")
        value = plan.micro_batch * (1.0 - 0.1 * plan.stage) * (0.7 if plan.checkpointing == "full" else 1.0)
        return ProbeOutcome(status="ok", samples_per_second=value, peak_memory_bytes=1000 * plan.micro_batch, ds_config={"stage": plan.stage})
