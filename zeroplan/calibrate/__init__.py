"""``zeroplan calibrate``: measure this machine (matmul, memory, collectives, host copies, CPU Adam,
a transformer step) into a GPU profile the estimator reads with ``--gpu profile.toml``.

Importing this package does not import torch; :func:`calibrate` does, in the parent and in the
worker processes it spawns.
"""

from zeroplan.calibrate.fit import CollectiveFit, fit_latency_bandwidth, ring_bytes
from zeroplan.calibrate.run import CalibrationError, CalibrationOptions, CalibrationResult, calibrate, default_processes, planned_steps

__all__ = [
    "CalibrationError",
    "CalibrationOptions",
    "CalibrationResult",
    "CollectiveFit",
    "calibrate",
    "default_processes",
    "fit_latency_bandwidth",
    "planned_steps",
    "ring_bytes",
]
