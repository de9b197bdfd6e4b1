"""``zeroplan doctor``: why a training run died, from its logs, and which plan fixes it; what a run
measured, beside the estimate. Pure Python: no torch import."""

from zeroplan.doctor.diagnose import MEMORY_CLASSES, Diagnosis, DoctorInputs, diagnose
from zeroplan.doctor.logs import LogLine, RunLog, read_logs
from zeroplan.doctor.measured import Measurement, compare, read_measurements
from zeroplan.doctor.rules import FAILURE_CLASSES, PHASES, RULES, FailureRule, Match, classify_log

__all__ = [
    "Diagnosis", "DoctorInputs", "FAILURE_CLASSES", "FailureRule", "LogLine", "MEMORY_CLASSES", "Match", "Measurement",
    "PHASES", "RULES", "RunLog", "classify_log", "compare", "diagnose", "read_logs", "read_measurements",
]
