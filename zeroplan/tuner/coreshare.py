"""How much of the time this machine's cores ran at reduced speed, from a fixed loop timed back to back.

On a virtual machine each core (vCPU) may be one hyperthread of a physical core whose other
hyperthread runs another tenant's work. While that sibling is busy the core runs slower, and
nothing inside the machine shows it: the load average, ``/proc/stat`` steal time and the process's
CPU time all read as if the core were alone. A fixed, tiny pure-Python loop timed again and again
shows it as two modes: chunks at the core's own speed ("alone") and chunks 1.8–1.9× slower
("shared"), switching every few milliseconds; on a 2-core cloud machine (2026-12-02) the share
of time in the slow mode went anywhere between 0 and 1 from one 0.25 s window to the next, each
core on its own, and a busy process on the other core did not raise it
(``benchmarks/machine_steadiness.py --competitor``).

:func:`classify_chunks` (pure) splits one series of chunk durations into the two modes and the
chunks something else lengthened (the thread was preempted or interrupted: far above both modes),
which are left out. :func:`measure_cores` pins the calling thread to each core it may run on in
turn, times the loop there and restores the affinity; where there is no affinity it times the loop
unpinned and says so. :class:`CoreWatch` keeps a tune's readings (and the fastest alone time
seen on this machine, between runs).

:func:`speed_swing` turns the lowest and highest shared fraction seen into how far that alone can
move a measured speed, which the tuner's ranking line gives beside its verdict (:class:`Trust`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["CoreReading", "CoreShare", "CoreWatch", "ShareBreakdown", "alone_cache_path", "classify_chunks", "measure_cores", "pinned_chunks", "run_delay_ns",
           "speed_swing", "time_chunks",
           "LOOP_ITERATIONS"]

#: Iterations of the timed loop: about 4.5 µs per chunk on a 2020s x86 core, so that the timer's
#: own cost (two ``perf_counter_ns`` calls, ~0.1 µs) is small and a slow spell of a few ms holds
#: hundreds of chunks.
LOOP_ITERATIONS = 200
#: Percentile of the chunk durations taken as the core's speed alone: low enough to sit inside the
#: fast mode unless the core was shared 99 % of the window (1 % of the chunks alone is 0.5 % of the
#: time), high enough that the few chunks faster than the mode (under 0.05 % of them, recorded)
#: do not set it.
ALONE_PERCENTILE = 1.0
#: Histogram bin width, as a factor: 4 % wide bins in log space.
_BIN = 1.04
#: Where the slow mode is looked for, as multiples of the alone time: above the alone mode's own
#: spread (its chunks stayed within 1.15×) and below what only a preemption or an interrupt makes.
_SLOW_FROM, _SLOW_TO = 1.3, 3.0
#: A chunk longer than this many times the slow mode's peak was lengthened by something else:
#: the slow mode's chunks stayed within ±15 % of its peak in the recorded series.
_DISTURBED_OVER_SLOW = 1.5
#: The slow mode's peak must hold this many times the chunks of the emptiest bin below it, else
#: there is no second mode (a core alone all along, or shared all along with no alone reference).
_PEAK_OVER_VALLEY = 3
#: A core whose own alone estimate is this much above another core's never ran alone in its window.
_NEVER_ALONE = 1.3
#: Fewest chunks a series must hold to be split into modes.
MIN_CHUNKS = 200


@dataclass(frozen=True)
class ShareBreakdown:
    """One series of chunk durations split into the core's own speed, the shared (slow) speed and
    disturbed chunks (:func:`classify_chunks`)."""

    alone_ns: float
    """Duration of one chunk at the core's own speed: the series' low percentile (ns)."""
    threshold_ns: float
    """Chunks up to this are alone, above it (up to ``disturbed_ns``) shared (ns)."""
    disturbed_ns: float
    """Chunks above this were lengthened by something else (preemption, an interrupt) and are left out (ns)."""
    slowdown: float
    """Median shared chunk over median alone chunk (1.0 when no chunk was shared)."""
    alone_s: float
    """Seconds spent in alone chunks."""
    shared_s: float
    """Seconds spent in shared chunks."""
    disturbed_s: float
    """Seconds spent in disturbed chunks (left out of the fraction)."""
    chunks: int
    """Chunks in the series."""
    disturbed_chunks: int
    """Chunks left out as disturbed."""
    alone_seen: bool = True
    """The series' own low percentile set ``alone_ns`` (False: the reference did; the core never ran alone)."""

    def __post_init__(self) -> None:
        for name in ("alone_ns", "threshold_ns", "disturbed_ns"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"ShareBreakdown.{name}={getattr(self, name)!r}: give a positive duration in ns")
        if not self.alone_ns <= self.threshold_ns <= self.disturbed_ns:
            raise ValueError(f"ShareBreakdown: alone_ns {self.alone_ns} <= threshold_ns {self.threshold_ns} <= disturbed_ns "
                             f"{self.disturbed_ns} does not hold")
        if min(self.alone_s, self.shared_s, self.disturbed_s) < 0:
            raise ValueError("ShareBreakdown: seconds per class must be >= 0")

    @property
    def shared_fraction(self) -> float:
        """Fraction of the undisturbed time the core ran shared (slow)."""
        total = self.alone_s + self.shared_s
        return self.shared_s / total if total > 0 else 0.0


def _percentile(ordered: Sequence[int], q: float) -> float:
    """The ``q``-th percentile of an ordered sequence (linear interpolation, numpy's default)."""
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def classify_chunks(durations_ns: Sequence[int], *, reference_alone_ns: Optional[float] = None) -> ShareBreakdown:
    """Split the durations (ns) of one fixed loop timed back to back on one core into alone, shared
    and disturbed chunks.

    * The alone time is the ``ALONE_PERCENTILE`` of the series. When ``reference_alone_ns`` (another
      core's or an earlier window's) is more than ``_NEVER_ALONE``× faster, this core never ran alone
      in the window and the reference is used instead (else its slow mode would read as its speed).
    * The slow mode's peak is the fullest 4 % bin (in log space) between 1.3× and 3× the alone time;
      when it holds under 3× the chunks of the emptiest bin below it there is no second mode, and
      every chunk past 1.3× the alone time counts as disturbed. A single series cannot tell a core
      shared all the time from one alone all the time: ``reference_alone_ns`` can.
    * The threshold between the modes is the emptiest bin between the alone time and that peak
      (the middle of the emptiest bins when several tie): where the two modes overlap least, so the
      exact place changes the count least. The valley is wide: in two 5 s series (one per core,
      2026-12-02 16:58 UTC) 1.1–1.7× the alone time held 0.6 % and 1.8 % of the chunks, and moving
      the threshold from 1.2× to 1.6× moved the fraction by 0.003 and 0.015.
    * Chunks over 1.5× the slow peak are disturbed: a preemption lengthens a chunk by a time slice
      (ms, hundreds of times the chunk), an interrupt by µs; neither is the core's speed. The slow
      mode's own chunks stayed within ±15 % of its peak.

    The fraction is of *time* (the sum of the shared chunks' durations over alone plus shared), not
    of chunks: a shared chunk lasts ~1.9× an alone one. Raises ValueError with fewer than
    ``MIN_CHUNKS`` chunks.
    """
    ordered = sorted(int(d) for d in durations_ns if d > 0)
    if len(ordered) < MIN_CHUNKS:
        raise ValueError(f"{len(ordered)} chunk durations are too few to split into modes (need {MIN_CHUNKS})")
    alone = _percentile(ordered, ALONE_PERCENTILE)
    seen = not (reference_alone_ns is not None and 0 < reference_alone_ns and alone > _NEVER_ALONE * reference_alone_ns)
    if not seen:
        alone = float(reference_alone_ns)
    log_bin = math.log(_BIN)
    nbins = int(math.log(_SLOW_TO) / log_bin) + 1
    counts = [0] * nbins
    for d in ordered:
        if d >= alone:
            k = int(math.log(d / alone) / log_bin)
            if k >= nbins:
                break
            counts[k] += 1
    first_slow = int(math.log(_SLOW_FROM) / log_bin)
    peak = max(range(first_slow, nbins), key=lambda k: (counts[k], -k))
    # The valley: bins strictly after the alone mode's own bin and before the slow peak.
    between = range(1, peak)
    fewest = min(counts[k] for k in between)
    if counts[peak] < _PEAK_OVER_VALLEY * max(fewest, 1):
        # One mode only: whatever lies past the alone mode's spread was lengthened by something else.
        threshold = disturbed = alone * _SLOW_FROM
    else:
        emptiest = [k for k in between if counts[k] == fewest]
        threshold = alone * _BIN ** (emptiest[len(emptiest) // 2] + 0.5)
        disturbed = _DISTURBED_OVER_SLOW * alone * _BIN ** (peak + 0.5)
    alone_d = [d for d in ordered if d <= threshold]
    shared_d = [d for d in ordered if threshold < d <= disturbed]
    other = [d for d in ordered if d > disturbed]
    alone_median = _percentile(alone_d, 50) if alone_d else alone
    slowdown = max(1.0, _percentile(shared_d, 50) / alone_median) if shared_d else 1.0
    return ShareBreakdown(
        alone_ns=alone, threshold_ns=threshold, disturbed_ns=disturbed, slowdown=slowdown,
        alone_s=sum(alone_d) / 1e9, shared_s=sum(shared_d) / 1e9, disturbed_s=sum(other) / 1e9,
        chunks=len(ordered), disturbed_chunks=len(other), alone_seen=seen,
    )


def time_chunks(seconds: float, *, iterations: int = LOOP_ITERATIONS) -> list[int]:
    """Durations (ns) of a fixed loop of ``iterations`` integer multiply-adds, timed back to back for
    ``seconds`` on whatever core the calling thread runs on."""
    clock = time.perf_counter_ns
    out: list[int] = []
    end = clock() + int(seconds * 1e9)
    while True:
        start = clock()
        total = 0
        for i in range(iterations):
            total += i * i
        stop = clock()
        out.append(stop - start)
        if stop > end:
            return out


def run_delay_ns() -> Optional[int]:
    """Nanoseconds the calling thread has waited on a run queue (Linux ``/proc/thread-self/schedstat``,
    its second field), or None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def pinned_chunks(core: int, seconds: float, *, iterations: int = LOOP_ITERATIONS) -> tuple[list[int], Optional[int]]:
    """:func:`time_chunks` with the calling thread pinned to ``core`` (its affinity restored after,
    also on error), and the nanoseconds it waited on a run queue meanwhile (:func:`run_delay_ns`;
    None where the kernel does not say): the kernel's own count of time taken by other threads."""
    before_affinity = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {core})
        before = run_delay_ns()
        durations = time_chunks(seconds, iterations=iterations)
        after = run_delay_ns()
    finally:
        os.sched_setaffinity(0, before_affinity)
    return durations, (after - before if before is not None and after is not None else None)


def _slowdown(breakdowns: Sequence[ShareBreakdown]) -> float:
    """The slow mode's slowdown over several series, each weighted by its time shared (1.0: none was)."""
    shared = sum(b.shared_s for b in breakdowns)
    return sum(b.slowdown * b.shared_s for b in breakdowns) / shared if shared > 0 else 1.0


@dataclass(frozen=True)
class CoreShare:
    """One core's series, split."""

    core: Optional[int]
    """The core the thread was pinned to (None: not pinned, the scheduler chose)."""
    breakdown: ShareBreakdown


@dataclass(frozen=True)
class CoreReading:
    """The cores measured at one moment (:func:`measure_cores`)."""

    cores: tuple[CoreShare, ...]
    note: str = ""
    """Empty, or what limits the reading (not pinned; some cores left out)."""
    wall_s: float = 0.0
    """Seconds the reading took."""

    @property
    def fractions(self) -> tuple[float, ...]:
        return tuple(c.breakdown.shared_fraction for c in self.cores)

    @property
    def mean_fraction(self) -> float:
        """The cores' shared fractions averaged: what a probe whose ranks run on every core meets."""
        return sum(self.fractions) / len(self.fractions)

    @property
    def slowdown(self) -> float:
        """The cores' slowdowns weighted by their time shared (1.0: none was)."""
        return _slowdown([c.breakdown for c in self.cores])

    @property
    def text(self) -> str:
        per_core = ", ".join(f"{'core ' + str(c.core) if c.core is not None else 'unpinned'} {c.breakdown.shared_fraction:.0%}"
                             for c in self.cores)
        return f"shared (slow) time {per_core}; slow mode {self.slowdown:.2f}× alone" + (f" ({self.note})" if self.note else "")


def measure_cores(*, seconds_per_core: float = 0.25, max_seconds: float = 0.6, reference_alone_ns: Optional[float] = None,
                  iterations: int = LOOP_ITERATIONS) -> CoreReading:
    """Time the loop ``seconds_per_core`` on each core the process may run on (the calling thread
    pinned to it), restore the thread's affinity (also on error) and split each series
    (:func:`classify_chunks`; every core's alone time checked against the fastest core's, or
    ``reference_alone_ns`` when faster).

    Why 0.25 s: the share itself moves on a scale of a second, so no short window reads a steady
    value. Over 10 s per core the share of consecutive windows had a standard deviation of
    0.31–0.35 at 25 ms, 0.28–0.33 at 0.25 s, 0.15–0.19 at 1 s and 0.10–0.11 at 2 s around a mean
    of 0.68–0.73 (2026-12-02 17:01 UTC, load 2.4), and 0.24–0.32, 0.15–0.21, 0.09–0.13 and
    0.03–0.10 around 0.28–0.36 (17:35 UTC, load 4.0). A reading of 0.25 s per core reads the moment (2 cores:
    0.55 s with the split); the tune takes the lowest and highest over cores and moments.

    At most ``max_seconds`` in all: with more cores than fit, an evenly spread subset is measured
    and the note says so. Without ``os.sched_setaffinity`` (not Linux) one series is timed unpinned.
    Raises ValueError only when no series could be split (too few chunks).
    """
    start = time.monotonic()
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    series: list[tuple[Optional[int], list[int]]] = []
    notes: list[str] = []
    if not allowed or not hasattr(os, "sched_setaffinity"):
        series.append((None, time_chunks(seconds_per_core, iterations=iterations)))
        notes.append("not pinned: no CPU affinity on this system, so one series over whichever cores ran it")
    else:
        fit = max(1, int(max_seconds / seconds_per_core)) if seconds_per_core > 0 else len(allowed)
        chosen = allowed if len(allowed) <= fit else [allowed[round(i * (len(allowed) - 1) / (fit - 1))] if fit > 1 else allowed[0]
                                                       for i in range(fit)]
        if len(chosen) < len(allowed):
            notes.append(f"{len(chosen)} of {len(allowed)} cores measured")
        for core in chosen:
            try:
                series.append((core, pinned_chunks(core, seconds_per_core, iterations=iterations)[0]))
            except OSError as exc:
                notes.append(f"core {core} not measured ({exc.strerror or exc})")
    usable = [(core, d) for core, d in series if len(d) >= MIN_CHUNKS]
    if not usable:
        raise ValueError(f"no core gave {MIN_CHUNKS} chunks in {seconds_per_core} s")
    own = [_percentile(sorted(d), ALONE_PERCENTILE) for _, d in usable]
    reference = min(own + ([reference_alone_ns] if reference_alone_ns else []))
    cores = tuple(CoreShare(core, classify_chunks(d, reference_alone_ns=reference)) for core, d in usable)
    return CoreReading(cores=cores, note="; ".join(notes), wall_s=time.monotonic() - start)


def speed_swing(fractions: tuple[float, float], slowdown: float) -> float:
    """How much faster a core runs at the lowest shared fraction than at the highest, as a fraction.

    In a fraction f of its time a core runs ``slowdown``× slower, so it does (1 − f) + f / slowdown
    of its alone work per second; the swing is that rate at ``min(fractions)`` over the rate at
    ``max(fractions)``, minus 1. E.g. 12–58 % at 1.9×: 0.943 / 0.725 − 1 = 30 %.
    """
    lo, hi = min(fractions), max(fractions)
    for f in (lo, hi):
        if not 0.0 <= f <= 1.0:
            raise ValueError(f"shared fraction {f} is not within 0..1")
    if not (math.isfinite(slowdown) and slowdown >= 1.0):
        raise ValueError(f"slowdown {slowdown} must be >= 1")

    def rate(f: float) -> float:
        return (1.0 - f) + f / slowdown

    return rate(lo) / rate(hi) - 1.0


#: Seconds a remembered alone time stays good without a reading that confirms it (within
#: ``_NEVER_ALONE``×): long enough to bridge minutes of a core shared throughout, short enough that
#: a machine moved to a slower host does not read as shared for long.
ALONE_KEPT_S = 24 * 3600.0


def alone_cache_path() -> Path:
    """Where the fastest alone time seen on this machine is kept between runs."""
    from zeroplan.runtime.rank.dsops import user_cache_dir

    return user_cache_dir() / "zeroplan" / "core_alone.json"


def _machine_key() -> str:
    """What the loop's speed alone depends on: the CPU model, the interpreter and the loop."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model} | {sys.implementation.name} {platform.python_version()} | loop {LOOP_ITERATIONS}"


class CoreWatch:
    """The readings of a tune: taken at the moments the tuner chooses (before its search, after its
    re-measurements), each core's alone time checked against the fastest seen so far — in this
    run, or in ``cache`` (:func:`alone_cache_path`) from earlier runs on this machine, since a core
    shared throughout a reading shows one mode only, which alone it would take for its own speed
    (on a 2-core cloud machine both cores ran shared for a whole second at times).
    A failed reading is a warning, never the tune's end. Without ``measure`` (a GPU's timings, which
    the host's cores do not set) it reads nothing."""

    def __init__(self, measure: Optional[Callable[..., CoreReading]] = None, *, cache: Optional[Path] = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.measure = measure
        self.cache = cache
        self.clock = clock
        self.readings: list[tuple[str, CoreReading]] = []

    def _remembered(self) -> Optional[float]:
        if self.cache is None:
            return None
        try:
            entry = json.loads(self.cache.read_text()).get(_machine_key())
            if entry and self.clock() - float(entry["when"]) <= ALONE_KEPT_S and float(entry["alone_ns"]) > 0:
                return float(entry["alone_ns"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # no cache or a broken one: this run's readings alone
        return None

    def _remember(self, alone_ns: float, remembered: Optional[float]) -> None:
        """Keep the fastest alone time; a reading within ``_NEVER_ALONE``× of it confirms it."""
        if self.cache is None or (remembered is not None and alone_ns > _NEVER_ALONE * remembered):
            return
        try:
            try:
                doc = json.loads(self.cache.read_text())
                doc = doc if isinstance(doc, dict) else {}
            except (OSError, ValueError):
                doc = {}
            doc[_machine_key()] = {"alone_ns": min(alone_ns, remembered or alone_ns), "when": self.clock()}
            self.cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.cache.with_name(f".{self.cache.name}.{os.getpid()}")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            os.replace(tmp, self.cache)
        except OSError:
            pass  # a read-only home: the next run measures without it

    def read(self, moment: str, on_event: Callable[..., Any] = lambda kind, **data: None) -> Optional[CoreReading]:
        """Take one reading labelled ``moment``; None (and a ``warning`` event) when it fails."""
        if self.measure is None:
            return None
        remembered = self._remembered()
        alone = [c.breakdown.alone_ns for _, r in self.readings for c in r.cores] + ([remembered] if remembered else [])
        try:
            reading = self.measure(reference_alone_ns=min(alone) if alone else None)
        except Exception as exc:  # noqa: BLE001 - a reading is a remark on the machine, never the tune's end
            on_event("warning", text=f"could not measure the cores' shared time ({type(exc).__name__}: {exc})")
            return None
        self.readings.append((moment, reading))
        seen = [c.breakdown.alone_ns for c in reading.cores if c.breakdown.alone_seen]
        if seen:
            self._remember(min(seen), remembered)
        return reading

    @property
    def shared_range(self) -> Optional[tuple[float, float]]:
        """Lowest and highest shared fraction over cores and readings (None: no reading)."""
        fractions = [f for _, r in self.readings for f in r.fractions]
        return (min(fractions), max(fractions)) if fractions else None

    @property
    def mean_range(self) -> Optional[tuple[float, float]]:
        """Lowest and highest of each reading's mean over the cores (None: no reading)."""
        means = [r.mean_fraction for _, r in self.readings]
        return (min(means), max(means)) if means else None

    @property
    def slowdown(self) -> Optional[float]:
        """The slow mode's slowdown over all readings, weighted by time shared (None: no reading)."""
        cores = [c.breakdown for _, r in self.readings for c in r.cores]
        return _slowdown(cores) if cores else None

    @property
    def text(self) -> str:
        """Every reading, for the report ("" when none)."""
        return "; ".join(f"{moment}: {reading.text}" for moment, reading in self.readings)
