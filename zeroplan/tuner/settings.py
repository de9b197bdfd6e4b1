"""What a search is asked to do (:class:`TuneSettings`) and what it reports back
(:class:`TuneSummary`, with :class:`Trust`: how far the ranking of its best plans holds)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Optional

from zeroplan.spec import SpecError
from zeroplan.tuner.coreshare import speed_swing
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
    gap between the first two, the machine's load while they were measured, and how much of the
    time its cores ran at reduced speed (shared with work outside the machine, which no load
    average shows: :mod:`zeroplan.tuner.coreshare`)."""

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
    core_shared: Optional[tuple[float, float]] = None
    """Lowest and highest fraction of time a core ran at reduced speed, over the cores and the
    readings before the search and after the re-measurements (None: not measured, e.g. on CUDA)."""
    core_slowdown: Optional[float] = None
    """How many times slower the fixed loop ran in that reduced-speed mode (None: not measured)."""
    machine_shared: Optional[tuple[float, float]] = None
    """Lowest and highest of each reading's fraction averaged over the cores — what a probe whose
    ranks run on every core meets — from which the line's remark on a held ranking is taken (None: ``core_shared``)."""

    def __post_init__(self) -> None:
        if self.core_shared is not None and not 0.0 <= self.core_shared[0] <= self.core_shared[1] <= 1.0:
            raise ValueError(f"Trust.core_shared={self.core_shared!r}: give (lowest, highest) fractions within 0..1")
        if self.machine_shared is not None and not 0.0 <= self.machine_shared[0] <= self.machine_shared[1] <= 1.0:
            raise ValueError(f"Trust.machine_shared={self.machine_shared!r}: give (lowest, highest) fractions within 0..1")
        if self.core_shared is not None and (self.core_slowdown is None or self.core_slowdown < 1.0):
            raise ValueError(f"Trust.core_slowdown={self.core_slowdown!r}: give the slow mode's slowdown (>= 1) with core_shared")

    @classmethod
    def of(cls, top: list[tuple[str, list[float], list[Any]]], *, load_1m: list[float], cores: int, watch: Any = None) -> "Trust":
        """The trust of a ranking from its (at most) two best plans, best first, each (plan key, its
        throughputs measured, the CPU seconds per step of each measurement: None where not
        measured), the 1-minute loads seen at each probe's start, the cores, and the tune's
        readings of the cores' reduced-speed time (``zeroplan.tuner.coreshare.CoreWatch``)."""
        medians = [statistics.median(m) for _, m, _ in top]
        spreads = [(max(m) - min(m)) / statistics.median(m) for _, m, _ in top if len(m) > 1]
        cpu_spreads = [(max(c) - min(c)) / statistics.median(c) for _, _, c in top if len(c) > 1 and all(c)]
        return cls(
            best_key=top[0][0],
            runner_up_key=top[1][0] if len(top) > 1 else None,
            gap=medians[0] / medians[1] - 1.0 if len(medians) > 1 and medians[1] > 0 else 0.0,
            repeat_spread=max(spreads) if spreads else 0.0,
            cpu_repeat_spread=max(cpu_spreads) if cpu_spreads else None,
            load_1m=(min(load_1m), max(load_1m)),
            cores=cores,
            core_shared=watch.shared_range if watch is not None else None,
            core_slowdown=watch.slowdown if watch is not None else None,
            machine_shared=watch.mean_range if watch is not None else None,
        )

    @property
    def share_swing(self) -> float:
        """How far the cores' reduced-speed time alone can move a measured speed between the readings
        (:func:`zeroplan.tuner.coreshare.speed_swing` over ``machine_shared``, else ``core_shared``;
        0 when not measured). The loop it comes from is the work that slows most of those measured
        (a vector add slowed 1.3×, a matmul less), so for a training step it is the widest the
        sharing can move it."""
        shared = self.machine_shared or self.core_shared
        if shared is None or self.core_slowdown is None:
            return 0.0
        return speed_swing(shared, self.core_slowdown)

    @property
    def firm(self) -> bool:
        """The best plan is ahead by more than the same plan's measurements differ (what was
        measured; the cores' reduced-speed time, a ceiling from the loop that slows most, only
        qualifies the line: :attr:`text`)."""
        return self.runner_up_key is None or self.gap > self.repeat_spread

    @property
    def text(self) -> str:
        load = f"load {self.load_1m[0]:.1f}–{self.load_1m[1]:.1f} on {self.cores} cores"
        if self.core_shared is not None:
            lo, hi = self.core_shared
            load += (f"; cores ran at reduced speed {lo * 100:.0f}–{hi:.0%} of the time, {self.core_slowdown:.1f}× slower "
                     "— shared with work outside this machine")
        if self.runner_up_key is None:
            return f"ranking: only {self.best_key} worked ({load})"
        verdict = "the ranking holds" if self.firm else "not told apart at this load: either may be the faster"
        if self.firm and self.share_swing > self.gap:
            verdict += (f" as measured, though the cores' reduced-speed time could move one plan's speed by up to {self.share_swing:.0%}: "
                        "measure again when they are less shared")
        cpu = ""
        if self.cpu_repeat_spread is not None and self.repeat_spread > 0:
            cpu = f", its CPU time per step by up to {self.cpu_repeat_spread:.0%}"
            if not self.firm and self.cpu_repeat_spread < self.repeat_spread / 2:
                verdict += " (the plans' work repeats; their wall time is their share of cores other jobs use)"
        return (f"ranking: {self.best_key} ahead of {self.runner_up_key} by {self.gap:.0%}, while one plan measured twice "
                f"differs by up to {self.repeat_spread:.0%}{cpu} ({load}): {verdict}")
