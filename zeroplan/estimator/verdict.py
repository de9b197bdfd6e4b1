"""One figure, one verdict: whether a plan fits, is tight, or runs out of memory. Stdlib only.

Each plan has one GPU figure — ``gpu.required``, what the GPU must have for the step not to run
out of memory (:class:`~zeroplan.estimator.plans.GpuMemory`) — and one host figure, host RAM per
node at the worst phase (``cpu_per_node``). The verdict compares each with its capacity:

* ``oom``: the figure is above the capacity;
* ``tight``: the figure is within :data:`TIGHT_MARGIN` of the capacity (above
  ``(1 − TIGHT_MARGIN) × capacity``): what the estimate leaves out or cannot know can tip it —
  the terms are listed per plan (:func:`uncertain_terms`);
* ``fits``: below that.

A plan's verdict is the worse of its GPU and host verdicts (an NVMe shortfall is ``oom``).

**The margin** was chosen on the tuning half of the public runs only
(benchmarks/public_runs.json, ``split: tuning``; benchmarks/bench_public_runs.py ``--choose-margin``
prints the sweep): the smallest margin at which at most 1 in 10 reported out-of-memory runs of
that half is called *fits*, provided *tight* stays at most a quarter of the runs. The held-out half is
reported beside it and never used to pick it (benchmarks/results/public_runs.txt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zeroplan.estimator.frozen import built

__all__ = [
    "VERDICTS",
    "TIGHT_MARGIN",
    "Headroom",
    "PlanVerdict",
    "judge",
    "combined_verdict",
    "gpu_headroom",
    "host_headroom",
    "judge_plan",
    "plan_verdict",
    "tight_note",
    "uncertain_terms",
    "verdict_rank",
]

#: The three verdicts, best first.
VERDICTS = ("fits", "tight", "oom")

#: Fraction of the capacity below it where a plan is called tight (module docstring: chosen on the
#: tuning half of benchmarks/public_runs.json; see docs/estimate.md, "The verdict and its margin").
TIGHT_MARGIN = 0.12

GiB = 1024**3


def verdict_rank(verdict: str) -> int:
    """0 for fits, 1 for tight, 2 for oom (the order plans are ranked and probed in)."""
    return VERDICTS.index(verdict)


def judge(figure_bytes: int, capacity_bytes: int, *, margin: float = TIGHT_MARGIN) -> str:
    """``fits``, ``tight`` or ``oom`` for ``figure_bytes`` against ``capacity_bytes``.

    oom above the capacity, tight above ``(1 − margin) × capacity``, fits below.
    """
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin!r}: give a fraction in [0, 1)")
    if capacity_bytes <= 0:
        raise ValueError(f"capacity_bytes={capacity_bytes!r}: give a positive capacity")
    if figure_bytes > capacity_bytes:
        return "oom"
    if figure_bytes > (1 - margin) * capacity_bytes:
        return "tight"
    return "fits"


@dataclass(frozen=True)
class Headroom:
    """One figure against one capacity (the ``headroom.gpu`` / ``headroom.host`` JSON objects)."""

    figure: str
    """Which figure is compared: ``gpu.required`` or ``cpu_per_node``."""
    figure_bytes: int
    """The figure, bytes."""
    capacity_bytes: int
    """The GPU's memory, or the node's host RAM, bytes."""
    verdict: str
    """``fits``, ``tight`` or ``oom`` for this figure alone."""
    uncertain: tuple[tuple[str, int], ...] = ()
    """For a tight verdict: the terms that make it uncertain, (term, bytes; 0 when not known)."""

    @property
    def headroom_bytes(self) -> int:
        """Capacity − figure, bytes (negative: short by that much)."""
        return self.capacity_bytes - self.figure_bytes

    @property
    def headroom_pct(self) -> float:
        """Headroom as a percentage of the capacity."""
        return 100.0 * self.headroom_bytes / self.capacity_bytes

    def as_dict(self) -> dict:
        return {
            "figure": self.figure,
            "figure_bytes": self.figure_bytes,
            "capacity_bytes": self.capacity_bytes,
            "headroom_bytes": self.headroom_bytes,
            "headroom_gib": round(self.headroom_bytes / GiB, 2),
            "headroom_pct": round(self.headroom_pct, 1),
            "verdict": self.verdict,
            "uncertain": [{"term": t, "bytes": b} for t, b in self.uncertain],
        }


@dataclass(frozen=True)
class PlanVerdict:
    """A plan's verdict: the worse of its GPU and host verdicts, with both headrooms."""

    verdict: str
    gpu: Headroom
    host: Optional[Headroom] = None
    """None when the node's host RAM is not known (``--cpu-memory`` / ``--node`` not given)."""
    nvme_short: bool = False
    """The plan needs more NVMe than the node has (or none was given): oom."""
    margin: float = TIGHT_MARGIN

    def as_dict(self) -> dict:
        return {
            "gpu": self.gpu.as_dict(),
            "host": self.host.as_dict() if self.host is not None else None,
            "nvme_short": self.nvme_short,
            "margin": self.margin,
        }


def uncertain_terms(
    *,
    expandable_segments: bool,
    stranded_bytes: int,
    optimizer_temporary_bytes: int,
    peak_phase: str,
    device: str = "cuda",
) -> tuple[tuple[str, int], ...]:
    """What the GPU figure does not hold or cannot know, for a plan near the card, with bytes where the
    estimate has them.

    * Allocator fragmentation without ``expandable_segments``: the transients whose cached segments
      the allocator strands (:mod:`zeroplan.estimator.allocator`); ``gpu.required`` leaves them out
      because a failing malloc frees them and retries, but a fragmented cache can still fail a
      large request.
    * Variable sequence lengths and padding: the estimate is at ``--seq-len``; a collator that pads
      to the longest sequence of the batch, or a longer sample, makes a larger batch.
    * Evaluation batches: an evaluation loop (Hugging Face's Trainer ``eval_steps``) holds logits
      for its own batch size beside the model states.
    * The optimizer step's temporaries: the step's fp32 copies (and a client torch optimizer's
      sqrt/denominator, :func:`~zeroplan.estimator.optimizer.optimizer_step_temporaries`) come on
      top of the states at the step's peak; which path torch takes depends on its version.
    """
    terms: list[tuple[str, int]] = []
    if device == "cuda" and not expandable_segments:
        terms.append(("allocator fragmentation (expandable_segments off)", stranded_bytes))
    terms.append(("variable sequence lengths and padding", 0))
    terms.append(("evaluation batches", 0))
    if optimizer_temporary_bytes or peak_phase == "step":
        terms.append(("optimizer-step temporaries", optimizer_temporary_bytes))
    return tuple(terms)


def plan_verdict(
    *,
    gpu_required_bytes: int,
    gpu_memory_bytes: int,
    cpu_per_node_bytes: int,
    cpu_memory_per_node_bytes: int,
    nvme_short: bool = False,
    gpu_uncertain: tuple[tuple[str, int], ...] = (),
    host_uncertain: tuple[tuple[str, int], ...] = (),
    margin: float = TIGHT_MARGIN,
) -> PlanVerdict:
    """The plan's verdict (module docstring) from its two figures and capacities.

    ``cpu_memory_per_node_bytes`` 0: host RAM not known, no host verdict.
    """
    gpu_v = judge(gpu_required_bytes, gpu_memory_bytes, margin=margin)
    gpu = _headroom("gpu.required", gpu_required_bytes, gpu_memory_bytes, gpu_v, gpu_uncertain)
    host = None
    if cpu_memory_per_node_bytes > 0:
        host_v = judge(cpu_per_node_bytes, cpu_memory_per_node_bytes, margin=margin)
        host = _headroom("cpu_per_node", cpu_per_node_bytes, cpu_memory_per_node_bytes, host_v, host_uncertain)
    return combined_verdict(gpu, host, nvme_short=nvme_short, margin=margin)


def _headroom(figure: str, figure_bytes: int, capacity_bytes: int, verdict: str, uncertain) -> Headroom:
    """One side's :class:`Headroom`; its uncertain terms are kept only when it is tight."""
    return built(Headroom, figure=figure, figure_bytes=figure_bytes, capacity_bytes=capacity_bytes, verdict=verdict,
                 uncertain=tuple(uncertain) if verdict == "tight" else ())


def judge_plan(
    gpu_required_bytes: int,
    cpu_per_node_bytes: int,
    cluster,
    *,
    nvme_short: bool,
    device: str,
    expandable_segments: bool,
    stranded_bytes: int,
    optimizer_temporary_bytes: int,
    peak_phase: str,
    model_build: str,
    build_defaulted: bool,
) -> PlanVerdict:
    """A plan's :class:`PlanVerdict` (both engines): ``gpu.required`` against ``cluster``'s GPU,
    host RAM per node against its node, with the terms that make a tight side uncertain (listed
    only for a tight side, as :func:`plan_verdict` keeps them: built only then). The same as
    :func:`combined_verdict` of :func:`gpu_headroom` and :func:`host_headroom`."""
    return combined_verdict(
        gpu_headroom(gpu_required_bytes, cluster, device=device, expandable_segments=expandable_segments, stranded_bytes=stranded_bytes,
                     optimizer_temporary_bytes=optimizer_temporary_bytes, peak_phase=peak_phase),
        host_headroom(cpu_per_node_bytes, cluster, model_build=model_build, build_defaulted=build_defaulted),
        nvme_short=nvme_short,
    )


def gpu_headroom(
    gpu_required_bytes: int, cluster, *, device: str, expandable_segments: bool, stranded_bytes: int, optimizer_temporary_bytes: int,
    peak_phase: str,
) -> Headroom:
    """The GPU side of :func:`judge_plan`: ``gpu.required`` against ``cluster``'s GPU, with the
    terms that make it uncertain when tight (:func:`uncertain_terms`)."""
    verdict = judge(gpu_required_bytes, cluster.gpu_memory_bytes)
    terms: tuple[tuple[str, int], ...] = ()
    if verdict == "tight":
        terms = uncertain_terms(
            expandable_segments=expandable_segments, stranded_bytes=stranded_bytes,
            optimizer_temporary_bytes=optimizer_temporary_bytes, peak_phase=peak_phase, device=device,
        )
    return _headroom("gpu.required", gpu_required_bytes, cluster.gpu_memory_bytes, verdict, terms)


def host_headroom(cpu_per_node_bytes: int, cluster, *, model_build: str, build_defaulted: bool) -> Optional[Headroom]:
    """The host side of :func:`judge_plan`: host RAM per node against ``cluster``'s node, with what
    the figure leaves out when tight; None when the node's RAM is not known. The same for every
    plan with the same host figure (an estimate's plans share a dozen)."""
    capacity = cluster.cpu_memory_per_node_bytes
    if capacity <= 0:
        return None
    verdict = judge(cpu_per_node_bytes, capacity)
    terms: list[tuple[str, int]] = []
    if verdict == "tight":
        if build_defaulted:
            terms.append((f"how the model is loaded (assumed {model_build}; --model-build)", 0))
        terms += [("dataset and tokenizer in host memory", 0), ("data-loader worker processes", 0)]
    return _headroom("cpu_per_node", cpu_per_node_bytes, capacity, verdict, terms)


def combined_verdict(gpu: Headroom, host: Optional[Headroom], *, nvme_short: bool, margin: float = TIGHT_MARGIN) -> PlanVerdict:
    """The plan's verdict from its two sides (module docstring): the worse of them, ``oom`` when it
    is short of NVMe; ``margin`` is the one the sides were judged with."""
    verdict = gpu.verdict
    if host is not None and verdict_rank(host.verdict) > verdict_rank(verdict):
        verdict = host.verdict
    if nvme_short:
        verdict = "oom"
    return built(PlanVerdict, verdict=verdict, gpu=gpu, host=host, nvme_short=nvme_short, margin=margin)


def tight_note(judgement: PlanVerdict) -> str:
    """The note of a tight plan: which side is tight, its headroom, and what makes it uncertain."""
    def gib(n: int) -> str:
        return f"{n / GiB:.1f} GiB"

    parts = []
    for side, h in (("GPU", judgement.gpu), ("CPU/node", judgement.host)):
        if h is None or h.verdict != "tight":
            continue
        terms = ", ".join(t + (f" {gib(b)}" if b else "") for t, b in h.uncertain)
        parts.append(
            f"{side} tight: {gib(h.figure_bytes)} of {gib(h.capacity_bytes)} leaves {gib(h.headroom_bytes)} "
            f"({h.headroom_pct:.0f} %, under the {judgement.margin * 100:.0f} % margin); uncertain: {terms}"
        )
    return "; ".join(parts)
