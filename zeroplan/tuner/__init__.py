"""Tuner: an Optuna search over the plans the estimator says fit, each trial measured by a probe.

``build_space`` enumerates and ranks plans; ``Tuner`` runs ask/tell trials with a runner
(``ProbeRunner`` runs real probes); ``write_results`` writes trials.csv, report.md,
throughput.png and the best ds_config.json. Optuna, pandas and matplotlib are imported lazily.
"""

from zeroplan.tuner.objective import PROBE_STATUSES, ProbeOutcome, ProbeRunner, Runner, check_tune_precision
from zeroplan.tuner.policy import WinnerCheck, prove_winner, tune_space
from zeroplan.tuner.results import CSV_COLUMNS, best_row, trials_frame, write_results
from zeroplan.tuner.search import SAMPLERS, TuneSettings, TuneSummary, Tuner, initial_candidates, make_sampler
from zeroplan.tuner.space import Candidate, SearchSpace, build_space, plan_key, zero_choice
from zeroplan.tuner.storage import STUDY_NAME, StorageError, open_storage, open_study, storage_url

__all__ = [
    "CSV_COLUMNS",
    "Candidate",
    "PROBE_STATUSES",
    "ProbeOutcome",
    "ProbeRunner",
    "check_tune_precision",
    "Runner",
    "SAMPLERS",
    "STUDY_NAME",
    "SearchSpace",
    "StorageError",
    "TuneSettings",
    "TuneSummary",
    "WinnerCheck",
    "Tuner",
    "best_row",
    "build_space",
    "initial_candidates",
    "make_sampler",
    "open_storage",
    "open_study",
    "plan_key",
    "prove_winner",
    "storage_url",
    "trials_frame",
    "tune_space",
    "write_results",
    "zero_choice",
]
