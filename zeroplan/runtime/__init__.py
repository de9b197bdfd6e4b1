"""Runtime: short probe jobs on a real engine (DeepSpeed or FSDP2), their ranks forked from a warm
process that imported torch once (zeroplan.runtime.launch.warm) or started by ``torchrun``.

Public API (stable; the tuner builds on it)::

    result = run_probe(ProbeRequest(script=Path("examples/gpt_task.py"), ds_config=cfg, nproc=2))
    result.status, result.step_time, result.peak_memory_per_rank, result.as_dict()

A probe never raises for a failing script: crashes, out-of-memory and hangs come back as a
:class:`ProbeResult` with ``status`` ``error``/``oom``/``timeout``. Bad requests raise SpecError.
torch and deepspeed are imported only inside the worker processes and the warm server.
"""

from __future__ import annotations

from zeroplan.runtime.api import BACKENDS, LOCAL_LAUNCHERS, STATUSES, ProbeRequest, ProbeResult
from zeroplan.runtime.launch.follow import FOLLOW_DONE, follow_probes
from zeroplan.runtime.probe import PHASES, probe_environment, run_probe, script_kind, uses_warm_launcher

__all__ = [
    "BACKENDS",
    "FOLLOW_DONE",
    "LOCAL_LAUNCHERS",
    "PHASES",
    "STATUSES",
    "ProbeRequest",
    "ProbeResult",
    "follow_probes",
    "probe_environment",
    "run_probe",
    "script_kind",
    "uses_warm_launcher",
]
