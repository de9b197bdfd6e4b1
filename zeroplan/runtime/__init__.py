"""Runtime: short probe jobs on a real engine (DeepSpeed or FSDP2) under ``torchrun``.

Public API (stable; the tuner builds on it)::

    result = run_probe(ProbeRequest(script=Path("examples/gpt_task.py"), ds_config=cfg, nproc=2))
    result.status, result.step_time, result.peak_memory_per_rank, result.as_dict()

A probe never raises for a failing script: crashes, out-of-memory and hangs come back as a
:class:`ProbeResult` with ``status`` ``error``/``oom``/``timeout``. Bad requests raise SpecError.
torch and deepspeed are imported only inside the worker processes.
"""

from __future__ import annotations

from zeroplan.runtime.api import BACKENDS, STATUSES, ProbeRequest, ProbeResult
from zeroplan.runtime.launcher import FOLLOW_DONE, follow_probes, run_probe, script_kind

__all__ = ["BACKENDS", "FOLLOW_DONE", "STATUSES", "ProbeRequest", "ProbeResult", "follow_probes", "run_probe", "script_kind"]
