"""Test-session environment: on a machine without CUDA, DeepSpeed runs on its CPU accelerator
(as `zeroplan probe` arranges for its own workers), so `python -m pytest` needs nothing set."""

from __future__ import annotations

import os
import shutil


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
