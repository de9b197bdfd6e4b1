"""Learning from failed probes: what kind of failure, its normalised signature, the region it rules out.

Each failed probe gets a :class:`Failure`: a *kind* (crash, engine assertion, OOM on the device
or on the host, hang), the *phase* it happened in (``start-up``: before the engine existed;
``first step``: engine built, no optimizer step done; ``steps``: between optimizer steps; the
phase comes from the progress lines the probe worker prints, ``zeroplan.runtime.rank.worker``), and a
*signature*: the error line with what varies between runs of the same bug removed (numbers,
paths, ranks, addresses), so the same bug in two plans has one signature.

Two failures with one signature teach a :class:`Region` — the plan factors they share (ZeRO
stage, an offload device, a checkpointing mode, and micro-batch ≥ the smaller of theirs unless the
failure happened at start-up, before any batch existed). Plans in a region are not probed. Rules:

* one failure is only a suspicion: at most one more probe (the confirmation) may share its
  factors before the region is ruled out;
* a hang at micro-batch k teaches like an OOM: plans at the same stage/offload with micro-batch
  ≥ k are skipped at once, and related plans at micro-batch ≥ k go last;
* a region holding a plan that worked is not learned (the factors are not the cause);
* OOMs keep their own memory rule (:func:`zeroplan.tuner.admission.oom_rule`), since less
  memory per GPU at another stage means an OOM at one stage says nothing about the others;
* if a learned region covers every plan left and no probe worked, the script fails whatever the
  plan: the search stops with the signature and what to fix (:func:`script_wide_failure`).

Pure functions over candidates and outcomes; no storage, no Optuna.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from zeroplan.tuner.space import Candidate, needs_at_least

__all__ = [
    "Failure",
    "FAILURE_KINDS",
    "FIXES",
    "Region",
    "classify_failure",
    "hang_rule",
    "learned_regions",
    "measurement_from_lines",
    "normalise_error",
    "outside_plan",
    "progress_from_lines",
    "region_of",
    "script_wide_failure",
    "suspect_rank",
]

#: Kinds of failure, as recorded in trials.csv (``failure`` column).
FAILURE_KINDS = ("crash", "assertion", "oom-device", "oom-host", "hang", "slow")

#: What to do when every plan fails the same way (printed with the signature).
FIXES = {
    "crash": "the script fails the same way whatever the plan: run it once by hand "
    "(zeroplan probe SCRIPT --gpus N --stage 0) and fix this error first",
    "assertion": "an assertion fails whatever the plan: run the script once by hand "
    "(zeroplan probe SCRIPT --gpus N --stage 0) and check what it asserts",
    "hang": "no plan gets past this point before --timeout: check the script's collectives "
    "(a rank-dependent branch, a barrier only some ranks reach) or raise --timeout if it is just slow",
    "oom-device": "every plan runs out of GPU memory: use a smaller model or sequence, or more GPUs",
    "oom-host": "every plan runs out of host memory: free host RAM, or probe with fewer ranks per node",
    "slow": "every probe is cut short while still stepping: raise --timeout",
}

#: Phases of a probe, in order.
PHASES = ("start-up", "first step", "steps")

_PROGRESS = re.compile(r"zeroplan-progress (engine-ready|step=(\d+)) t=([\d.]+)")
_RANK = re.compile(r"\brank\s*\d+\b:?\s*", re.I)
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[\w.~-]*/)+[\w.-]+")
_ADDR = re.compile(r"\b0x[0-9a-fA-F]+\b")
_SHAPE = re.compile(r"\b\d+(?:x\d+)+\b")
_NUMBER = re.compile(r"(?<![A-Za-z_])[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
_DEVICE_OOM = re.compile(r"CUDA|HIP|cuda|device|CUBLAS|NCCL", re.I)


#: Errors that are this machine's or zeroplan's launcher's, whatever the plan: a port taken by
#: another job between choosing and binding it (torch's TCPStore: "Address already in use"), a
#: rendezvous or socket torn down by a peer process, a DeepSpeed op whose compilation failed or
#: was stopped (torch.utils.cpp_extension: "Error building extension"), the warm launcher.
_OUTSIDE_PLAN = re.compile(
    r"Address already in use|EADDRINUSE|DistNetworkError|Connection reset by peer|Broken pipe|"
    r"Error building extension|ninja: build stopped|warm launcher unavailable",
    re.I,
)


def outside_plan(status: str, error: str, log_tail: str = "", *, waits_s: Optional[dict] = None) -> Optional[str]:
    """Why a failed probe failed for a reason outside its plan (the tuner runs it once more and
    does not learn from it), else None: a timeout that came after waiting on an op build (the
    build's time was not charged, but the ranks' start was disturbed by it), or an error from
    :data:`_OUTSIDE_PLAN` in its message or log."""
    if status == "timeout" and (waits_s or {}).get("op build"):
        return f"timed out after waiting {waits_s['op build']:.0f} s on a DeepSpeed op build"
    if status in ("error", "timeout"):
        m = _OUTSIDE_PLAN.search(error or "") or _OUTSIDE_PLAN.search(log_tail or "")
        if m:
            return f"{m.group(0)} (the machine's or the launcher's, not the plan's)"
    return None


def normalise_error(text: str) -> str:
    """The error line without what differs between runs of one bug: ranks, paths, addresses, numbers.

    ``"rank 1: AssertionError: bad shape 4096 at /tmp/x/y.py:12 (0x7f3a)"`` →
    ``"AssertionError: bad shape N at <path>:N (<addr>)"``.
    """
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = _RANK.sub("", line)
    line = _ADDR.sub("<addr>", line)
    line = _PATH.sub("<path>", line)
    line = _SHAPE.sub(lambda m: "x".join("N" * (m.group(0).count("x") + 1)), line)
    line = _NUMBER.sub("N", line)
    return re.sub(r"\s+", " ", line).strip()


def progress_from_lines(lines: Iterable[str]) -> tuple[Optional[float], int, Optional[float]]:
    """(seconds to engine ready, optimizer steps done, seconds at the last step) from a probe's
    progress lines; (None, 0, None) when it printed none."""
    ready: Optional[float] = None
    steps = 0
    last: Optional[float] = None
    for line in lines:
        m = _PROGRESS.search(line)
        if not m:
            continue
        t = float(m.group(3))
        if m.group(1) == "engine-ready":
            ready = t
        else:
            steps = max(steps, int(m.group(2)))
            last = t
    return ready, steps, last


_MEASURED = re.compile(r"zeroplan-progress measured step_time=([\d.]+) ci=([\d.]+) micro=(\d+)")


def measurement_from_lines(lines: Iterable[str]) -> Optional[tuple[float, float, int]]:
    """(step time s, 95% half-width s, micro-steps) from the worker's last ``measured`` line, if any."""
    found = None
    for line in lines:
        m = _MEASURED.search(line)
        if m:
            found = (float(m.group(1)), float(m.group(2)), int(m.group(3)))
    return found


@dataclass(frozen=True)
class Failure:
    """One failed probe, classified."""

    kind: str
    """One of :data:`FAILURE_KINDS`."""
    phase: Optional[str]
    """``start-up`` | ``first step`` | ``steps``; None when the probe printed no progress."""
    signature: str
    """``kind[/phase]: normalised error line``: equal for the same bug in different plans."""

    @property
    def label(self) -> str:
        where = {"start-up": "at start-up", "first step": "before the first step", "steps": "between steps"}
        return f"{self.kind} {where[self.phase]}" if self.phase else self.kind


def classify_failure(
    status: str, error: str, *, engine_ready: Optional[bool], optimizer_steps: int, cut_short: bool = False
) -> Optional[Failure]:
    """The :class:`Failure` of a probe that ended with ``status`` (None for ``ok``/``invalid``).

    ``engine_ready``: the engine was built (None: unknown, the probe printed no progress);
    ``optimizer_steps``: optimizer steps done before it failed; ``cut_short``: the timeout was one
    derived from earlier probes, shorter than --timeout — a probe it stops while stepping is
    ``slow`` (it works, more slowly than expected), not a hang, and teaches nothing about others.
    """
    if status not in ("error", "oom", "timeout"):
        return None
    if engine_ready is None and optimizer_steps == 0:
        phase: Optional[str] = None
    elif optimizer_steps > 0:
        phase = "steps"
    elif engine_ready:
        phase = "first step"
    else:
        phase = "start-up"
    if status == "timeout":
        kind, message = ("slow" if cut_short and optimizer_steps > 0 else "hang"), ""
    elif status == "oom":
        kind, message = ("oom-device" if _DEVICE_OOM.search(error) else "oom-host"), normalise_error(error)
    else:
        message = normalise_error(error)
        kind = "assertion" if "AssertionError" in error else "crash"
    head = f"{kind}/{phase}" if phase else kind
    return Failure(kind=kind, phase=phase, signature=f"{head}: {message}" if message else head)


@dataclass(frozen=True)
class Region:
    """Plans sharing the factors two same-signature failures share (None: any value)."""

    signature: str
    trials: tuple[int, int]
    """The two trials that taught it."""
    stage: Optional[int] = None
    offload_optimizer: Optional[str] = None
    offload_param: Optional[str] = None
    checkpointing: Optional[str] = None
    min_micro_batch: Optional[int] = None

    def contains(self, cand: Candidate) -> bool:
        p = cand.plan
        return (
            (self.stage is None or p.stage == self.stage)
            and (self.offload_optimizer is None or p.offload_optimizer == self.offload_optimizer)
            and (self.offload_param is None or p.offload_param == self.offload_param)
            and (self.checkpointing is None or p.checkpointing == self.checkpointing)
            and (self.min_micro_batch is None or p.micro_batch >= self.min_micro_batch)
        )

    @property
    def description(self) -> str:
        parts = []
        if self.stage is not None:
            parts.append(f"ZeRO-{self.stage}")
        if self.offload_optimizer is not None:
            parts.append(f"optimizer offload {self.offload_optimizer}")
        if self.offload_param is not None:
            parts.append(f"parameter offload {self.offload_param}")
        if self.checkpointing is not None:
            parts.append(f"checkpointing {self.checkpointing}")
        if self.min_micro_batch is not None:
            parts.append(f"micro-batch ≥ {self.min_micro_batch}")
        return ", ".join(parts) or "every plan"

    @property
    def reason(self) -> str:
        a, b = self.trials
        return f"region fails ({self.description}): {self.signature} in trials #{a} and #{b}"


def region_of(a: tuple[int, Candidate, Failure], b: tuple[int, Candidate, Failure]) -> Optional[Region]:
    """The region two failures teach: None unless they have one signature.

    A factor belongs to the region when both plans share it; an offload or checkpointing shared at
    ``none`` is not a suspect (it is the default, not a choice that can break). Micro-batch ≥ the
    smaller of the two, unless both failed at start-up (before the first batch existed).
    """
    (na, ca, fa), (nb, cb, fb) = a, b
    if fa.signature != fb.signature or ca.key == cb.key:
        return None
    pa, pb = ca.plan, cb.plan

    def shared(x: str, y: str) -> Optional[str]:
        return x if x == y and x != "none" else None

    startup = fa.phase == "start-up" and fb.phase == "start-up"
    return Region(
        signature=fa.signature,
        trials=(min(na, nb), max(na, nb)),
        stage=pa.stage if pa.stage == pb.stage else None,
        offload_optimizer=shared(pa.offload_optimizer, pb.offload_optimizer),
        offload_param=shared(pa.offload_param, pb.offload_param),
        checkpointing=shared(pa.checkpointing, pb.checkpointing),
        min_micro_batch=None if startup else min(pa.micro_batch, pb.micro_batch),
    )


def learned_regions(failures: Sequence[tuple[int, Candidate, Failure]], successes: Sequence[Candidate]) -> list[Region]:
    """Every region taught by a pair of same-signature failures (OOMs excluded, see the module
    docstring) that holds no plan that worked."""
    out: list[Region] = []
    learnable = [f for f in failures if not f[2].kind.startswith("oom") and f[2].kind != "slow"]
    for i, a in enumerate(learnable):
        for b in learnable[i + 1:]:
            region = region_of(a, b)
            if region is not None and not any(region.contains(ok) for ok in successes) and region not in out:
                out.append(region)
    return out


def hang_rule(cand: Candidate, failures: Sequence[tuple[int, Candidate, Failure]]) -> Optional[str]:
    """Reason to skip ``cand``: a hang at the same stage/offload with a micro-batch no larger (and
    no less checkpointing) — a hang at micro-batch k teaches like an OOM at k."""
    for number, bad, failure in failures:
        if failure.kind != "hang" or bad.key == cand.key or failure.phase == "start-up":
            continue
        if needs_at_least(cand.plan, bad.plan):
            return f"micro-batch at least that of a hang (trial #{number}: {bad.plan.label}, {failure.label})"
    return None


def suspect_rank(cand: Candidate, failures: Sequence[tuple[int, Candidate, Failure]]) -> int:
    """How many single failures ``cand`` shares a suspect factor with (0: none); plans with more go later.

    A start-up failure makes its stage suspect; any other non-OOM failure at micro-batch k makes
    micro-batch ≥ k suspect (at every stage).
    """
    n = 0
    for _, bad, failure in failures:
        if failure.kind.startswith("oom") or failure.kind == "slow" or bad.key == cand.key:
            continue
        if failure.phase == "start-up":
            n += cand.plan.stage == bad.plan.stage
        else:
            n += cand.plan.micro_batch >= bad.plan.micro_batch
    return n


def script_wide_failure(regions: Sequence[Region], remaining: Sequence[Candidate], successes: Sequence[Candidate]) -> Optional[tuple[str, str]]:
    """(signature, fix) when no probe worked and one learned region covers every plan left."""
    if successes or not remaining:
        return None
    for region in regions:
        if all(region.contains(c) for c in remaining):
            kind = region.signature.split(":", 1)[0].split("/", 1)[0]
            return region.signature, FIXES.get(kind, FIXES["crash"])
    return None
