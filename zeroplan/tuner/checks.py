"""Checks that need torch or DeepSpeed, each run in a child Python so the tuner process stays light:

* :func:`task_declaration` — what a zeroplan task declares for the estimator: its ModelSpec,
  sequence length and loss;
* :func:`deepspeed_parse_error` — whether DeepSpeed's own config parser (``DeepSpeedConfig``)
  accepts a config at a given data-parallel world size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from zeroplan.spec import ModelSpec, SpecError

__all__ = ["TaskDeclaration", "task_declaration", "deepspeed_parse_error", "deepspeed_installed", "PACKAGE_ROOT"]

PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("DS_ACCELERATOR", "cpu" if not _cuda_visible() else env.get("DS_ACCELERATOR", "cuda"))
    return env


def _cuda_visible() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount() > 0
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: no CUDA
        return False


def cuda_visible() -> bool:
    """True when NVML sees at least one NVIDIA GPU (probes then run on CUDA)."""
    return _cuda_visible()


def deepspeed_installed() -> bool:
    """True when the deepspeed package can be found (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


@dataclass(frozen=True)
class TaskDeclaration:
    """What ``zeroplan_task()`` declares for the estimator (``zeroplan.spec.Task``)."""

    model_spec: Optional[ModelSpec]
    """``Task.model_spec`` (None: the task declares no shape)."""
    seq_len: Optional[int]
    """``Task.seq_len``, tokens per sample (None: not declared)."""
    loss: Optional[str]
    """``Task.loss``, what its loss keeps over the logits (``zeroplan.spec.LOSSES``; None: not declared)."""


def task_declaration(script: Path, script_args: tuple[str, ...] = (), *, timeout_s: float = 120.0) -> TaskDeclaration:
    """The model shape, sequence length and loss ``zeroplan_task()`` in ``script`` declares.

    Runs the task's builder in a child process exactly as the probe worker does (``sys.argv`` =
    script + its arguments), so task flags such as ``--layers`` apply.
    """
    code = (
        "import json, sys\n"
        "from zeroplan.runtime.rank.task import load_task\n"
        "task = load_task(sys.argv[1], tuple(sys.argv[2:]))\n"
        "spec = task.model_spec.as_dict() if task.model_spec is not None else None\n"
        "print('ZEROPLAN_TASK ' + json.dumps({'model_spec': spec, 'seq_len': task.seq_len, 'loss': task.loss}))\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(script.resolve()), *script_args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_child_env(),
            cwd=str(script.resolve().parent),
        )
    except subprocess.TimeoutExpired:
        raise SpecError(f"{script}: zeroplan_task() did not return within {timeout_s:.0f} s") from None
    for line in proc.stdout.splitlines():
        if line.startswith("ZEROPLAN_TASK "):
            data = json.loads(line[len("ZEROPLAN_TASK "):])
            spec = data.get("model_spec")
            model = None
            if spec:
                spec = {k: (tuple(v) if k == "notes" else v) for k, v in spec.items()}
                model = ModelSpec.from_dict(spec)
            return TaskDeclaration(model_spec=model, seq_len=data.get("seq_len"), loss=data.get("loss"))
    raise SpecError(f"{script}: zeroplan_task() failed: {_last_line(proc.stderr or proc.stdout)}")


_PARSE_CODE = """
import json, sys
cfg = json.loads(sys.stdin.read())
world = int(sys.argv[1])

# DeepSpeedConfig asks deepspeed.comm for rank and world size and falls back to a world of 1 when
# no process group exists; answer as the N-rank job would, so the batch assertion
# (train_batch_size == micro x accumulation x world) is checked for the real world size.
import deepspeed.comm as dist
dist.get_rank = lambda *args, **kwargs: 0
dist.get_world_size = lambda *args, **kwargs: world

from deepspeed.runtime.config import DeepSpeedConfig
DeepSpeedConfig(cfg)
print("ZEROPLAN_DS_OK")
"""


def deepspeed_parse_error(cfg: dict, *, world_size: int, timeout_s: float = 180.0) -> Optional[str]:
    """None when ``deepspeed.runtime.config.DeepSpeedConfig`` accepts ``cfg`` at ``world_size``; else its error line."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PARSE_CODE, str(world_size)],
            input=json.dumps(cfg),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=_child_env(),
        )
    except subprocess.TimeoutExpired:
        return f"DeepSpeed's parser did not finish within {timeout_s:.0f} s"
    if "ZEROPLAN_DS_OK" in proc.stdout:
        return None
    return _last_line(proc.stderr or proc.stdout)
