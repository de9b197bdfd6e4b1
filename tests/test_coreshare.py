"""The cores' reduced-speed time (zeroplan.tuner.coreshare): the split of a recorded series against
an independent one (Otsu's threshold in numpy), a series built with a known answer, the kernel's
own count of the time a thread waited to run, and what the tuner does with the readings.

The fixtures are real: ``tests/data/coreshare_chunks*.json.gz`` are 0.1 s of the loop pinned to
core 0 of the project's 2-core AMD EPYC virtual machine (chosen from nine recordings: a mixed one,
a mostly shared one, one shared throughout), recorded with
``python benchmarks/machine_steadiness.py --record PATH`` (2026-12-02 17:04 UTC, load 1.1-1.2;
each file says how, when and what ``/proc/thread-self/schedstat`` counted meanwhile).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from zeroplan.tuner import coreshare
from zeroplan.tuner.coreshare import CoreReading, CoreShare, CoreWatch, classify_chunks, measure_cores, speed_swing
from zeroplan.tuner.settings import Trust

from helpers import ROOT

DATA = ROOT / "tests" / "data"
FIXTURES = ["coreshare_chunks.json.gz", "coreshare_chunks_mostly_shared.json.gz"]


def recorded(name: str) -> np.ndarray:
    with gzip.open(DATA / name, "rt") as f:
        return np.asarray(json.load(f)["durations_ns"], dtype=np.int64)


def otsu_split(durations: np.ndarray) -> tuple[float, float]:
    """(shared fraction of time, slowdown) by another route: chunks over 3× the 1st percentile cut
    as disturbed, then Otsu's threshold (N. Otsu, "A threshold selection method from gray-level
    histograms", IEEE SMC 9(1), 1979: the cut maximising the between-class variance) on a
    256-bin histogram of the log durations."""
    base = np.percentile(durations, 1)
    kept = durations[durations <= 3 * base].astype(float)
    hist, edges = np.histogram(np.log(kept), bins=256)
    mids = (edges[:-1] + edges[1:]) / 2
    w0 = np.cumsum(hist)
    w1 = w0[-1] - w0
    m0 = np.cumsum(hist * mids) / np.maximum(w0, 1)
    m1 = (np.sum(hist * mids) - np.cumsum(hist * mids)) / np.maximum(w1, 1)
    cut = np.exp(edges[1:][np.argmax(w0 * w1 * (m0 - m1) ** 2)])
    slow, fast = kept[kept > cut], kept[kept <= cut]
    return slow.sum() / kept.sum(), np.median(slow) / np.median(fast)


@pytest.mark.parametrize("name", FIXTURES)
def test_a_recorded_series_splits_as_otsus_threshold_splits_it(name):
    durations = recorded(name)
    expected_fraction, expected_slowdown = otsu_split(durations)
    b = classify_chunks(durations.tolist())
    assert b.chunks == len(durations)
    assert b.shared_fraction == pytest.approx(expected_fraction, abs=0.01)
    assert b.slowdown == pytest.approx(expected_slowdown, rel=0.03)
    assert 1.6 < b.slowdown < 2.1  # the two modes the machine shows, not one split in two
    assert b.alone_s + b.shared_s + b.disturbed_s == pytest.approx(durations.sum() / 1e9)


def test_a_series_built_with_a_known_answer():
    """Real alone chunks of the fixture; a known 40 % of their time made 1.9× slower (contiguous
    spells, as the machine shows them) and 20 preemptions of 3 ms put in between."""
    real = recorded(FIXTURES[0])
    alone = real[real <= 1.15 * np.percentile(real, 1)][:4000].astype(np.int64)
    slow = np.round(alone * 1.9).astype(np.int64)
    built, shared_ns, total_ns = [], 0, 0
    for i in range(len(alone)):
        spell = (i // 200) % 5 in (1, 3)  # 2 spells of 200 in every 1000 chunks
        d = int(slow[i] if spell else alone[i])
        built.append(d)
        shared_ns += d if spell else 0
        total_ns += d
        if i % 200 == 100:
            built.append(3_000_000)
    b = classify_chunks(built)
    assert b.shared_fraction == pytest.approx(shared_ns / total_ns, abs=1e-9)
    assert b.disturbed_chunks == 20 and b.disturbed_s == pytest.approx(20 * 3e-3)
    assert b.slowdown == pytest.approx(1.9, rel=0.01)


def test_one_mode_only_is_no_shared_time_and_a_reference_finds_a_core_never_alone():
    real = recorded(FIXTURES[0])
    alone = real[real <= 1.15 * np.percentile(real, 1)][:3000]
    b = classify_chunks(alone.tolist())
    assert b.shared_fraction == 0.0 and b.slowdown == 1.0
    # The same chunks 1.9× slower: alone by themselves (one mode), shared against the fast core.
    slow = np.round(alone * 1.9).astype(np.int64).tolist()
    assert classify_chunks(slow).shared_fraction == 0.0
    against = classify_chunks(slow, reference_alone_ns=float(np.median(alone)))
    assert against.shared_fraction == 1.0 and against.slowdown == pytest.approx(1.9, rel=0.03)
    with pytest.raises(ValueError, match="too few"):
        classify_chunks([4000] * 10)


def test_a_core_shared_for_a_whole_recorded_series_is_one_mode_not_split_in_two():
    """0.1 s of core 0 recorded a few seconds after the mixed series, all of it in the slow mode
    (its 1st percentile 1.67× the mixed series'): alone it is one mode (shared 0, not a sliver of
    its own tail); against the mixed series' alone time it was shared throughout."""
    one = recorded("coreshare_chunks_one_mode.json.gz")
    b = classify_chunks(one.tolist())
    assert (b.shared_fraction, b.slowdown, b.alone_seen) == (0.0, 1.0, True)
    reference = classify_chunks(recorded(FIXTURES[0]).tolist()).alone_ns
    against = classify_chunks(one.tolist(), reference_alone_ns=reference)
    assert against.shared_fraction > 0.99 and not against.alone_seen
    assert 1.6 < against.slowdown < 2.1


def test_speed_swing_is_the_work_rate_at_the_lowest_share_over_the_highest():
    # 12-58 % at 1.9x: (0.88 + 0.12/1.9) / (0.42 + 0.58/1.9) - 1
    assert speed_swing((0.12, 0.58), 1.9) == pytest.approx((0.88 + 0.12 / 1.9) / (0.42 + 0.58 / 1.9) - 1)
    assert speed_swing((0.3, 0.3), 1.9) == 0.0 and speed_swing((0.0, 1.0), 2.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="within 0..1"):
        speed_swing((0.1, 1.2), 1.9)


def _synthetic(n: int = 400) -> list[int]:
    return [4000] * n + [7600] * (n // 2)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_each_core_is_measured_pinned_and_the_affinity_restored(monkeypatch):
    before = os.sched_getaffinity(0)
    seen = []

    def timed(seconds, *, iterations):
        seen.append(os.sched_getaffinity(0))
        return _synthetic()

    monkeypatch.setattr(coreshare, "time_chunks", timed)
    reading = measure_cores(seconds_per_core=0.01, max_seconds=1000)
    assert [c.core for c in reading.cores] == sorted(before)
    assert seen == [{c} for c in sorted(before)]
    assert os.sched_getaffinity(0) == before
    # 4000 ns × 400 alone, 7600 ns × 200 shared: 1,520,000 of 3,120,000 ns
    assert reading.fractions == pytest.approx([1_520_000 / 3_120_000] * len(before))

    def broken(seconds, *, iterations):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(coreshare, "time_chunks", broken)
    with pytest.raises(RuntimeError, match="interrupted"):
        measure_cores(seconds_per_core=0.01)
    assert os.sched_getaffinity(0) == before


def test_without_affinity_one_series_is_timed_unpinned_and_said(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity", raising=False)
    monkeypatch.setattr(coreshare, "time_chunks", lambda seconds, *, iterations: _synthetic())
    reading = measure_cores()
    assert [c.core for c in reading.cores] == [None]
    assert "not pinned" in reading.note and "unpinned" in reading.text


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_a_real_reading_of_every_core_is_short():
    reading = measure_cores(seconds_per_core=0.05)
    assert len(reading.cores) == min(len(os.sched_getaffinity(0)), 12)
    assert reading.wall_s < 0.05 * len(reading.cores) + 0.5
    assert all(0.0 <= f <= 1.0 for f in reading.fractions)


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists() or not hasattr(os, "sched_setaffinity"),
                    reason="needs Linux's schedstat and CPU affinity")
def test_a_busy_process_on_the_same_core_is_disturbed_time_not_shared_time():
    """Linux time-slices two busy threads on one core: the loop's thread waits whole slices (ms),
    which the kernel counts as run_delay (``/proc/thread-self/schedstat``). Those waits must be the
    disturbed chunks, so they stay out of the reduced-speed share. The kernel's count is the
    independent truth; the loop runs pinned to the busy process's core and its affinity comes back."""
    core = min(os.sched_getaffinity(0))
    before_affinity = os.sched_getaffinity(0)
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        time.sleep(0.2)
        durations, waited_ns = coreshare.pinned_chunks(core, 0.4)
    finally:
        busy.kill()
        busy.wait()
    assert os.sched_getaffinity(0) == before_affinity
    waited_s = waited_ns / 1e9
    b = classify_chunks(durations)
    wall_s = sum(durations) / 1e9
    assert waited_s > 0.2 * wall_s, "the busy process did not share the core"
    # A wait that falls between two timed chunks is in no chunk; a disturbed chunk also holds its own µs.
    assert 0.8 * waited_s <= b.disturbed_s <= 1.1 * waited_s + 0.02


def test_the_trust_line_says_the_cores_reduced_speed_and_qualifies_a_verdict_it_could_overturn():
    """The verdict rests on what was measured (the gap against one plan's repeat spread); the cores'
    reduced-speed time, a ceiling taken from the loop that slows most, is said beside it and
    qualifies a held ranking whose gap it could close."""
    plain = Trust(best_key="a", runner_up_key="b", gap=0.4, repeat_spread=0.1, load_1m=(0.3, 0.5), cores=2)
    assert plain.firm and "reduced speed" not in plain.text
    shared = Trust(best_key="a", runner_up_key="b", gap=0.4, repeat_spread=0.1, load_1m=(0.3, 0.5), cores=2,
                   core_shared=(0.05, 0.84), core_slowdown=1.9)
    swing = (0.95 + 0.05 / 1.9) / (0.16 + 0.84 / 1.9) - 1  # 62 %
    assert shared.share_swing == pytest.approx(swing)
    assert shared.firm  # 40 % ahead, one plan's readings 10 % apart
    assert "cores ran at reduced speed 5–84% of the time, 1.9× slower — shared with work outside this machine)" in shared.text
    assert shared.text.endswith(f"the ranking holds as measured, though the cores' reduced-speed time could move one plan's speed by up to "
                                f"{swing:.0%}: measure again when they are less shared")
    apart = Trust(best_key="a", runner_up_key="b", gap=0.4, repeat_spread=0.5, load_1m=(0.3, 0.5), cores=2,
                  core_shared=(0.05, 0.84), core_slowdown=1.9)
    assert not apart.firm and apart.text.endswith("not told apart at this load: either may be the faster")
    # A probe's ranks run on every core: the verdict's bound takes each reading's mean over them.
    averaged = Trust(best_key="a", runner_up_key="b", gap=0.4, repeat_spread=0.1, load_1m=(0.3, 0.5), cores=2,
                     core_shared=(0.05, 0.84), core_slowdown=1.9, machine_shared=(0.3, 0.45))
    assert averaged.share_swing == pytest.approx((0.7 + 0.3 / 1.9) / (0.55 + 0.45 / 1.9) - 1) and averaged.firm
    assert "reduced speed 5–84%" in averaged.text and averaged.text.endswith("the ranking holds")  # 40 % > the 22 % it allows
    calm = Trust(best_key="a", runner_up_key="b", gap=0.4, repeat_spread=0.1, load_1m=(0.3, 0.5), cores=2,
                 core_shared=(0.1, 0.2), core_slowdown=1.9)
    assert calm.firm and calm.text.endswith("the ranking holds")
    only = Trust(best_key="a", runner_up_key=None, gap=0.0, repeat_spread=0.0, load_1m=(0.3, 0.5), cores=2,
                 core_shared=(0.1, 0.2), core_slowdown=1.9)
    assert "reduced speed 10–20%" in only.text
    with pytest.raises(ValueError, match="core_shared"):
        Trust(best_key="a", runner_up_key=None, gap=0.0, repeat_spread=0.0, load_1m=(0.3, 0.5), cores=2, core_shared=(0.5, 0.2), core_slowdown=1.9)


def _reading(*fractions: float, alone_ns: float = 4000.0) -> CoreReading:
    cores = []
    for core, f in enumerate(fractions):
        b = coreshare.ShareBreakdown(alone_ns=alone_ns, threshold_ns=5600, disturbed_ns=12000, slowdown=1.9, alone_s=1 - f, shared_s=f,
                                     disturbed_s=0.0, chunks=1000, disturbed_chunks=0)
        cores.append(CoreShare(core, b))
    return CoreReading(cores=tuple(cores))


def test_the_tuner_reads_the_cores_before_the_search_and_after_it_into_trust(tmp_path):
    from zeroplan.tuner import TuneSettings, Tuner, make_sampler, open_study, storage_url

    from helpers import Replay, make_space

    readings = [_reading(0.12, 0.3, alone_ns=4100), _reading(0.58, 0.2)]
    references = []

    def measure(*, reference_alone_ns=None):
        references.append(reference_alone_ns)
        return readings.pop(0)

    study = open_study(storage_url(str(tmp_path / "study.journal"), tmp_path), resume=False, sampler=make_sampler("tpe", seed=1))
    watch = CoreWatch(measure)
    tuner = Tuner(study, make_space(global_batch=2), Replay(oom_from=None), TuneSettings(trials=2, n_initial=2), cores=watch)
    tuner.prepare(resume=False)
    summary = tuner.run()
    assert [moment for moment, _ in watch.readings] == ["before the search", "after the search"]
    assert references == [None, 4100]  # the first reading's alone time checks the second's
    assert summary.trust.core_shared == (0.12, 0.58) and summary.trust.core_slowdown == pytest.approx(1.9)
    assert summary.trust.machine_shared == pytest.approx((0.21, 0.39))
    assert "reduced speed 12–58%" in summary.trust.text
    assert "before the search: shared (slow) time core 0 12%, core 1 30%" in watch.text


def test_a_failed_reading_is_a_warning_not_the_tunes_end():
    events = []

    def measure(*, reference_alone_ns=None):
        raise ValueError("no core gave 200 chunks")

    watch = CoreWatch(measure)
    assert watch.read("before the search", lambda kind, **data: events.append((kind, data["text"]))) is None
    assert events == [("warning", "could not measure the cores' shared time (ValueError: no core gave 200 chunks)")]
    assert watch.shared_range is None and watch.slowdown is None and watch.text == ""
    assert CoreWatch().read("before the search") is None  # on CUDA: nothing read


def test_the_fastest_alone_time_is_kept_between_runs_so_a_core_shared_throughout_is_found(tmp_path):
    """A core shared for a whole reading shows one mode; the alone time remembered from an earlier
    run (the real recorded series, then the same chunks 1.9x slower) tells it was shared."""
    cache = tmp_path / "core_alone.json"
    real = recorded(FIXTURES[0])
    alone = real[real <= 1.15 * np.percentile(real, 1)][:3000]
    series = [alone.tolist(), np.round(alone * 1.9).astype(np.int64).tolist()]
    passed = []

    def measure(*, reference_alone_ns=None):
        passed.append(reference_alone_ns)
        return CoreReading(cores=(CoreShare(0, classify_chunks(series.pop(0), reference_alone_ns=reference_alone_ns)),))

    now = [1000.0]
    first = CoreWatch(measure, cache=cache, clock=lambda: now[0])
    assert first.read("before the search").fractions == (0.0,)
    later = CoreWatch(measure, cache=cache, clock=lambda: now[0] + 3600)
    assert later.read("before the search").fractions == (1.0,)
    assert passed == [None, pytest.approx(np.percentile(alone, 1))]
    # The shared series did not replace the remembered alone time; a day later it is forgotten.
    (entry,) = json.loads(cache.read_text()).values()
    assert entry == {"alone_ns": pytest.approx(np.percentile(alone, 1)), "when": 1000.0}
    assert CoreWatch(measure, cache=cache, clock=lambda: now[0] + 2 * 86400)._remembered() is None
    cache.write_text("{broken")
    assert CoreWatch(measure, cache=cache)._remembered() is None
