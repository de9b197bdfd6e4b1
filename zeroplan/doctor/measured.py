"""Peak memory and throughput that real runs already log, for comparison with the estimate.

Readers (pure functions of the text a run wrote):

* DeepSpeed ``see_memory_usage`` (deepspeed/runtime/utils.py): ``MA 1.78 GB  Max_MA 2.15 GB  CA 2.26 GB
  Max_CA 2 GB`` — allocated, peak allocated, reserved, peak reserved, each bytes / 1024³ (so GiB),
  Max_CA rounded to a whole number;
* torchtitan's step line (torchtitan/components/metrics.py ``MetricsProcessor.log``):
  ``step: 10  loss: 7.9  memory: 33.55GiB(35.32%)  tps: 5,432`` — peak reserved GiB, tokens per
  second per GPU (older versions print ``wps``);
* torchtune's ``log_memory_stats`` (``GPU peak memory allocation: 2.41 GB`` / ``reserved`` /
  ``active``, torch.cuda.max_memory_* / 1024³) and its metric lines (``peak_memory_alloc:2.41``,
  ``tokens_per_second_per_gpu:1234``);
* the HF Trainer's ``trainer_state.json`` (or its ``train_results.json``): ``log_history``'s final
  ``train_samples_per_second`` and, with
  ``skip_memory_metrics=False``, ``train_mem_gpu_peaked_delta`` + ``train_mem_gpu_alloc_delta``
  (bytes; transformers/trainer_utils.py ``TrainerMemoryTracker``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from zeroplan.doctor.logs import RunLog

__all__ = ["Measurement", "read_measurements", "compare"]


@dataclass(frozen=True)
class Measurement:
    """What one run logged about itself."""

    source: str
    """Which reader found it: ``deepspeed``, ``torchtitan``, ``torchtune`` or ``hf-trainer``."""
    where: str
    """``file:line`` (or the file) of the figure."""
    peak_allocated_gib: Optional[float] = None
    """Largest peak allocated memory logged (torch.cuda.max_memory_allocated), GiB."""
    peak_reserved_gib: Optional[float] = None
    """Largest peak reserved memory logged (torch.cuda.max_memory_reserved), GiB."""
    tokens_per_second_per_gpu: Optional[float] = None
    samples_per_second: Optional[float] = None
    """Across all GPUs (the HF Trainer's figure)."""
    train_batch_size: Optional[int] = None
    """Per-device batch the Trainer ran (trainer_state.json ``train_batch_size``)."""
    notes: tuple[str, ...] = field(default=())


_DS = re.compile(r"\bMA ([\d.]+) GB\s+Max_MA ([\d.]+) GB\s+CA ([\d.]+) GB\s+Max_CA ([\d.]+) GB")
_TITAN = re.compile(r"memory:\s*([\d.]+)\s*GiB\(([\d.]+)%\)(?:.*?\b(?:tps|wps):\s*([\d,]+))?")
_TUNE = re.compile(r"GPU peak memory (allocation|reserved|active): ([\d.]+) GB")
_TUNE_METRIC = re.compile(r"peak_memory_(alloc|reserved|active)\s*[:=]\s*([\d.]+)")
_TUNE_TPS = re.compile(r"tokens_per_second_per_gpu\s*[:=]\s*([\d.]+)")


def read_measurements(log: RunLog) -> list[Measurement]:
    """Every reader's figures in ``log`` (one Measurement per reader that found something)."""
    out: list[Measurement] = []
    ds = [(ln, _DS.search(ln.text)) for ln in log.lines]
    ds = [(ln, m) for ln, m in ds if m]
    if ds:
        ln, m = max(ds, key=lambda x: float(x[1].group(2)))
        out.append(Measurement("deepspeed", ln.where, peak_allocated_gib=float(m.group(2)),
                               peak_reserved_gib=max(float(x[1].group(4)) for x in ds),
                               notes=(f"largest Max_MA of {len(ds)} see_memory_usage lines ({ln.text.split(' MA ')[0].strip()[:60]})",)))
    titan = [(ln, _TITAN.search(ln.text)) for ln in log.lines if "step" in ln.text]
    titan = [(ln, m) for ln, m in titan if m]
    if titan:
        ln, m = max(titan, key=lambda x: float(x[1].group(1)))
        tps = [float(x[1].group(3).replace(",", "")) for x in titan[1:] if x[1].group(3)]  # the first step includes warm-up
        out.append(Measurement("torchtitan", ln.where, peak_reserved_gib=float(m.group(1)),
                               tokens_per_second_per_gpu=sum(tps) / len(tps) if tps else None))
    alloc = reserved = None
    where = None
    tps = []
    for ln in log.lines:
        for m in list(_TUNE.finditer(ln.text)) + list(_TUNE_METRIC.finditer(ln.text)):
            value = float(m.group(2))
            if m.group(1).startswith("alloc"):
                alloc = max(alloc or 0.0, value)
                where = ln.where
            elif m.group(1) == "reserved":
                reserved = max(reserved or 0.0, value)
        t = _TUNE_TPS.search(ln.text)
        if t:
            tps.append(float(t.group(1)))
    if alloc is not None or reserved is not None:
        out.append(Measurement("torchtune", where or "", peak_allocated_gib=alloc, peak_reserved_gib=reserved,
                               tokens_per_second_per_gpu=sum(tps) / len(tps) if tps else None))
    for name, doc in log.json_docs:
        m = _from_trainer_state(name, doc)
        if m is not None:
            out.append(m)
    return out


def _from_trainer_state(name: str, doc) -> Optional[Measurement]:
    if not isinstance(doc, dict):
        return None
    if isinstance(doc.get("log_history"), list):  # trainer_state.json
        history = [e for e in doc["log_history"] if isinstance(e, dict)]
        final = next((e for e in reversed(history) if "train_samples_per_second" in e or "train_runtime" in e), {})
    elif "train_runtime" in doc or "train_samples_per_second" in doc:  # train_results.json / all_results.json
        final = doc
    else:
        return None
    peak = None
    if isinstance(final.get("train_mem_gpu_peaked_delta"), (int, float)) and isinstance(final.get("train_mem_gpu_alloc_delta"), (int, float)):
        # transformers/trainer_utils.py TrainerMemoryTracker.stop: alloc delta = allocated at the
        # stage's end - at its start; peaked delta = max_memory_allocated - allocated at the end.
        # So the peak = train's start + both deltas, and train's start = what was allocated before
        # the Trainer's __init__ + init's alloc delta (nothing is allocated between them).
        start = (final.get("before_init_mem_gpu") or 0) + (final.get("init_mem_gpu_alloc_delta") or 0)
        peak = (start + final["train_mem_gpu_alloc_delta"] + final["train_mem_gpu_peaked_delta"]) / 2**30
    sps = final.get("train_samples_per_second")
    notes = []
    if peak is None:
        notes.append("no memory figures (the Trainer logs them only with skip_memory_metrics=False)")
    return Measurement("hf-trainer", name, peak_allocated_gib=peak, samples_per_second=float(sps) if sps is not None else None,
                       train_batch_size=doc.get("train_batch_size"), notes=tuple(notes))


def compare(measurement: Measurement, estimate, *, world_size: int, seq_len: int) -> list[tuple[str, Optional[float], Optional[float]]]:
    """(figure, measured, predicted) rows for one measurement beside the estimator's
    :class:`~zeroplan.estimator.PlanEstimate` of the same setting."""
    gib = 2**30
    rows = [
        ("peak allocated GiB per GPU", measurement.peak_allocated_gib, estimate.gpu.peak_allocated / gib),
        ("peak reserved GiB per GPU", measurement.peak_reserved_gib, (estimate.gpu.peak_reserved or estimate.gpu.peak_allocated) / gib),
    ]
    tps_gpu = estimate.tokens_per_second / world_size
    if measurement.tokens_per_second_per_gpu is not None:
        rows.append(("tokens/s per GPU", measurement.tokens_per_second_per_gpu, tps_gpu))
    if measurement.samples_per_second is not None:
        rows.append(("samples/s (all GPUs)", measurement.samples_per_second, estimate.tokens_per_second / seq_len))
    return [r for r in rows if r[1] is not None]
