"""What a search is asked to do (:class:`TuneSettings`) and what it reports back
(:class:`TuneSummary`, with :class:`Trust`: how far the ranking of its best plans holds)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from zeroplan.spec import SpecError
from zeroplan.tuner.probetime import Gap

__all__ = ["Trust", "TuneSettings", "TuneSummary"]


@dataclass(frozen=True)
class TuneSettings:
    """How long to search and how."""

    trials: int = 8
    """Probes the study should hold (all workers together); pruned/duplicate trials do not count."""
    time_budget_s: Optional[float] = None
    """Wall-clock seconds of this process's search: no probe starts after it, nor one whose expected
    duration (``Tuner.expected_probe_s``) would take it past (None: no limit)."""
    n_initial: Optional[int] = None
    """Estimator-ranked plans enqueued before the sampler (None: ceil(trials / 2))."""
    probe_timeout_s: float = 300.0
    """Per-probe timeout, used for the claim deadline other workers check."""
    max_rejections: int = 3
    """Sampler proposals rejected in a row before the best-predicted untried plan is enqueued."""
    stale_grace_s: float = 120.0
    """Extra seconds past a claim's probe timeout before another worker may declare it dead."""
    remeasure_top: int = 2
    """Plans measured again, once each, before the best is named (the best ones by their first
    measurement; 0: none). They do not count against ``trials``."""

    def __post_init__(self) -> None:
        if isinstance(self.trials, bool) or not isinstance(self.trials, int) or self.trials < 1:
            raise SpecError(f"--trials {self.trials!r} is not valid; give a whole number >= 1")
        if self.time_budget_s is not None and not (math.isfinite(self.time_budget_s) and self.time_budget_s > 0):
            raise SpecError(f"--time-budget {self.time_budget_s} is not valid; give seconds > 0")
        if self.n_initial is not None and self.n_initial < 0:
            raise SpecError(f"n_initial={self.n_initial} must be >= 0")
        if not (math.isfinite(self.probe_timeout_s) and self.probe_timeout_s > 0):
            raise SpecError(f"--timeout {self.probe_timeout_s} is not valid; give seconds > 0")

    @property
    def initial(self) -> int:
        return self.n_initial if self.n_initial is not None else max(1, math.ceil(self.trials / 2))


@dataclass
class TuneSummary:
    """What a run of :meth:`Tuner.run` did."""

    probes_in_study: int
    """Trials in the study that ran a probe (all workers, all runs)."""
    probes_this_run: int
    """Probes this process ran."""
    stopped_because: str
    """trials reached | time budget | space exhausted | every plan fails."""
    best_number: Optional[int] = None
    best_value: Optional[float] = None
    best_plan_key: Optional[str] = None
    wall_s: float = 0.0
    events: list[str] = field(default_factory=list)
    failure_signature: Optional[str] = None
    """When every plan fails the same way: the failure's signature."""
    failure_fix: Optional[str] = None
    """... and what to fix."""
    gap: Optional[Gap] = None
    """How much faster the best admissible plan not probed is predicted to be than the best found."""
    trust: Optional[Trust] = None
    """How far the ranking of the top plans can be trusted (after they were measured again)."""


@dataclass(frozen=True)
class Trust:
    """How much the ranking of the best plans can be trusted: their measurements repeated, the
    gap between the first two, and the machine's load while they were measured."""

    best_key: str
    runner_up_key: Optional[str]
    """The second plan by median throughput (None: only one plan worked)."""
    gap: float
    """(best − runner-up) / runner-up median samples/s; 0 without a runner-up."""
    repeat_spread: float
    """Largest (max − min) / median over the repeated measurements of one plan (0: none repeated)."""
    load_1m: tuple[float, float]
    """Lowest and highest 1-minute load average seen at the start of each probe."""
    cores: int
    cpu_repeat_spread: Optional[float] = None
    """As ``repeat_spread`` for the CPU seconds per step of the busiest rank (None: not measured,
    e.g. on CUDA): the plan's own work, which other jobs on the machine change little."""

    @property
    def firm(self) -> bool:
        """The best plan is ahead by more than the same plan's measurements differ."""
        return self.runner_up_key is None or self.gap > self.repeat_spread

    @property
    def text(self) -> str:
        load = f"load {self.load_1m[0]:.1f}–{self.load_1m[1]:.1f} on {self.cores} cores"
        if self.runner_up_key is None:
            return f"ranking: only {self.best_key} worked ({load})"
        verdict = "the ranking holds" if self.firm else "not told apart at this load: either may be the faster"
        cpu = ""
        if self.cpu_repeat_spread is not None and self.repeat_spread > 0:
            cpu = f", its CPU time per step by up to {self.cpu_repeat_spread:.0%}"
            if not self.firm and self.cpu_repeat_spread < self.repeat_spread / 2:
                verdict += " (the plans' work repeats; their wall time is their share of cores other jobs use)"
        return (f"ranking: {self.best_key} ahead of {self.runner_up_key} by {self.gap:.0%}, while one plan measured twice "
                f"differs by up to {self.repeat_spread:.0%}{cpu} ({load}): {verdict}")
