"""Turn what a finished job left behind (exit code, per-rank results, log) into a status."""

from __future__ import annotations

import re
import statistics

from zeroplan.runtime.rank.moe_leaf import LEAF_WARNING_PREFIX

__all__ = ["OOM_PATTERN", "SIGKILL_PATTERN", "classify", "summarize_ranks", "last_error_line"]

#: Log text that means the allocator (CUDA or host) ran out: torch.OutOfMemoryError, Python's
#: MemoryError, c10's DefaultCPUAllocator, C++ std::bad_alloc, errno ENOMEM.
OOM_PATTERN = re.compile(
    r"out of memory|OutOfMemoryError|MemoryError|Cannot allocate memory|std::bad_alloc"
    r"|DefaultCPUAllocator: can't allocate memory|CUBLAS_STATUS_ALLOC_FAILED",
    re.I,
)
#: A rank killed by SIGKILL: torchrun's summary, its signal line, DeepSpeed's launcher (launch.py sigkill_handler).
SIGKILL_PATTERN = re.compile(r"exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)|exits with return code = -9\b")
#: gloo's abort when ranks enter different collectives (pair.cc: "Is there a distributed collective mismatch").
_COLLECTIVE_MISMATCH = re.compile(r"collective mismatch", re.I)
_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+(?:Error|Exception|Interrupt|Exit)|AssertionError|ChildFailedError)\b.*")


def last_error_line(log_text: str) -> str | None:
    """The last ``SomethingError: message`` line of a log, if any (torchrun's own summary excluded)."""
    lines = [ln.strip() for ln in log_text.splitlines() if _ERROR_LINE.match(ln) and "ChildFailedError" not in ln]
    return lines[-1] if lines else None


def classify(
    *,
    returncode: int | None,
    timed_out: bool,
    timeout_s: float,
    ranks: list[dict],
    expected_ranks: int,
    log_text: str,
) -> tuple[str, str | None]:
    """(status, readable reason) of a finished probe job.

    Order: our timeout; a rank's own report (oom before error); every rank ok; then the log and the
    exit code for ranks that died without reporting (SIGKILL with no result is almost always the
    kernel's OOM killer, which leaves no message).
    """
    # A rank said before its first step why ZeRO-3 would hang — or, over gloo, abort on mismatched
    # collective sizes (zeroplan.runtime.rank.moe_leaf); a run that then fails without a result says so.
    hint = next((ln.strip().split("zeroplan: ", 1)[-1] for ln in log_text.splitlines() if LEAF_WARNING_PREFIX in ln), None)
    cause = f"; likely cause: {hint}" if hint else ""
    if timed_out:
        return "timeout", f"no result within {timeout_s:g} s; the job and all its processes were killed{cause}"
    for wanted in ("oom", "error"):
        for r in sorted(ranks, key=lambda r: r.get("rank", 0)):
            if r.get("status") == wanted:
                return wanted, f"rank {r.get('rank')}: {r.get('error') or wanted}"
    ok_ranks = [r for r in ranks if r.get("status") == "ok"]
    if ok_ranks and len(ok_ranks) >= expected_ranks:
        return "ok", None
    code = "no exit code" if returncode is None else f"exit code {returncode}"
    if OOM_PATTERN.search(log_text):
        line = last_error_line(log_text) or "out of memory"
        return "oom", f"{line} ({code})"
    if SIGKILL_PATTERN.search(log_text) or returncode in (-9, 137):
        return "oom", f"a worker was killed by SIGKILL with no result, usually the kernel's out-of-memory killer ({code})"
    line = last_error_line(log_text)
    if line is None and _COLLECTIVE_MISMATCH.search(log_text):
        line = "gloo: received data size doesn't match expected size (a distributed collective mismatch)"
    missing = expected_ranks - len(ok_ranks)
    reason = f"{missing} of {expected_ranks} ranks wrote no result ({code}){cause}"
    return "error", f"{line}; {reason}" if line else reason


def summarize_ranks(ranks: list[dict]) -> dict:
    """Combine per-rank measurements: slowest rank's step time, every rank's peak memory."""
    ok = sorted((r for r in ranks if r.get("status") == "ok"), key=lambda r: r.get("rank", 0))
    out: dict = {}
    if ranks:
        out["world_size"] = max(int(r.get("world_size") or 0) for r in ranks) or None
        first = min(ranks, key=lambda r: r.get("rank", 0))
        out["model_spec"] = first.get("model_spec")
        out["task_loss"] = first.get("task_loss")
        out["seq_len"] = first.get("seq_len")
        out["trainable_params"] = first.get("trainable_params")
        out["frozen_params"] = first.get("frozen_params")
        out["discovered"] = first.get("discovered")
        out["engine_batch"] = first.get("engine_batch")
        out["parameter_sizes"] = first.get("parameter_sizes")
        for key in ("trainer", "recipe", "trl", "frozen_engines", "fused_lm_head"):
            out[key] = first.get(key)
        out["memory_phases_per_rank"] = [r.get("memory_phases") or {} for r in sorted(ranks, key=lambda r: r.get("rank", 0))]
    peaks = [(r.get("rank", 0), r.get("peak_memory")) for r in sorted(ranks, key=lambda r: r.get("rank", 0))]
    peaks = [p for _, p in peaks if isinstance(p, int)]
    if peaks:
        out["peak_memory_per_rank"] = peaks
        out["peak_memory"] = max(peaks)
        out["memory_kind"] = next((r.get("memory_kind") for r in ranks if r.get("memory_kind")), None)
    by_rank = sorted(ranks, key=lambda r: r.get("rank", 0))
    out["step_time_per_rank"] = [r.get("step_time") if r.get("status") == "ok" else None for r in by_rank]
    if any(r.get("node_rank") is not None for r in by_rank):
        out["node_per_rank"] = [r.get("node_rank") for r in by_rank]
    states = [r.get("state_memory") for r in sorted(ranks, key=lambda r: r.get("rank", 0))]
    if states and all(isinstance(b, int) for b in states):
        out["state_memory_per_rank"] = states
    if not ok:
        out["steps"] = max((int(r.get("steps") or 0) for r in ranks), default=0)
        return out
    out["steps"] = min(int(r.get("steps") or 0) for r in ok)
    cpu = [statistics.median(r["step_cpu_times"]) for r in ok if r.get("step_cpu_times")]
    if cpu and len(cpu) == len(ok):
        out["cpu_step_time"] = max(cpu)
    times = [r["step_time"] for r in ok if r.get("step_time")]
    if times:
        step_time = max(times)
        out["step_time"] = step_time
        samples = ok[0].get("samples_per_step")
        if samples:
            out["samples_per_second"] = samples / step_time
            seq_len = ok[0].get("seq_len")
            if seq_len:
                out["tokens_per_second"] = samples * seq_len / step_time
    return out
