"""Host memory of a probe: each rank's peak RSS per phase, and the node's RSS sampled from outside.

* :class:`PhaseRss` runs in the worker. At each phase boundary (model build → engine init →
  step → checkpoint save) it reads the kernel's exact peak-RSS high-water mark of the process
  (``VmHWM`` in ``/proc/self/status``) and resets it (``echo 5 > /proc/self/clear_refs``, Linux ≥ 4.0),
  so every phase gets its own peak at no cost per step. Where the reset is refused the marks are
  cumulative (each phase's peak is then the peak so far) and ``reset`` says so. Not Linux: psutil's
  current RSS at the boundaries only.
* :class:`NodeRssSampler` runs in the launcher: a thread that every ``interval_s`` sums the RSS of
  torchrun and every worker with psutil, counting shared file-backed pages (the torch and CUDA
  libraries every rank maps) once: Σ(rss − shared) + max(shared).

Only the standard library and psutil; no torch import.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Iterable

__all__ = ["PHASES", "PhaseRss", "NodeRssSampler", "device_bytes_on_host", "estimated_host", "memory_limit", "is_build_tool", "node_rss", "pinned_bytes_now", "summarize_host"]

#: Phases a probe reports, in order (same names as :data:`zeroplan.estimator.HOST_PHASES`).
PHASES = ("model_build", "engine_init", "step", "checkpoint_save")

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kib(key: str) -> int | None:
    try:
        with open(_STATUS) as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _rss_now() -> int | None:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:  # noqa: BLE001 - no measurement is better than a failed probe
        return None


def pinned_bytes_now() -> int | None:
    """Host bytes DeepSpeed has pinned so far in this process (its pin-memory tracker), if exposed."""
    try:
        from deepspeed.utils import pin_memory_tracker

        return int(pin_memory_tracker._tracker._bytes)
    except Exception:  # noqa: BLE001 - older DeepSpeed or no DeepSpeed: not exposed
        return None


class PhaseRss:
    """Peak RSS of this process per phase (bytes), from the kernel's high-water mark."""

    def __init__(self) -> None:
        self.baseline_bytes = _rss_now()
        self.peaks: dict[str, int] = {}
        self.starts: dict[str, float] = {}
        self.phase: str | None = None
        self.reset = self._reset()

    @staticmethod
    def _reset() -> bool:
        try:
            with open(_CLEAR_REFS, "w") as fh:
                fh.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        """The process is ready to run the user's code (torch and the engine imported): take the
        baseline and enter ``model_build``."""
        self.baseline_bytes = _rss_now()
        self.enter("model_build")

    def _close(self) -> None:
        if self.phase is None:
            return
        hwm = _status_kib("VmHWM")
        peak = hwm * 1024 if hwm is not None else _rss_now()
        if peak is not None:
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), peak)

    def enter(self, phase: str) -> None:
        """Close the current phase (record its peak) and start ``phase``."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} is not one of {PHASES}")
        if phase == self.phase:
            return
        self._close()
        if self.reset:
            self._reset()
        self.phase = phase
        self.starts.setdefault(phase, time.time())

    def finish(self) -> None:
        self._close()
        self.phase = None

    def as_dict(self) -> dict:
        return {
            "host_baseline": self.baseline_bytes,
            "host_phase_peaks": dict(self.peaks),
            "host_phase_starts": dict(self.starts),
            "host_peak": max(self.peaks.values()) if self.peaks else None,
            "host_hwm_reset": self.reset,
            "pinned_bytes": pinned_bytes_now(),
        }


#: Process names of extension-op builds (ninja, GCC/Clang drivers and passes, the linker, nvcc).
BUILD_TOOLS = frozenset({
    "ninja", "c++", "g++", "gcc", "cc", "cc1", "cc1plus", "as", "ld", "collect2", "clang", "clang++",
    "nvcc", "cicc", "ptxas", "fatbinary", "nvlink", "sh",
})


def is_build_tool(name: str) -> bool:
    """Whether a process name (Linux ``comm``: the executable's base name, cut at 15 characters)
    is a build tool: one of :data:`BUILD_TOOLS`, or a cross-named driver such as
    ``x86_64-linux-gnu-g++-12`` (seen as ``x86_64-linux-gn``)."""
    if name in BUILD_TOOLS:
        return True
    return bool(re.match(r"^(x86_64|aarch64|arm|powerpc64le|ppc64le|s390x|riscv64)[\w.]*-linux-gn", name))


def node_rss(pids: Iterable[int]) -> int:
    """RSS of a process tree with shared pages counted once: Σ(rss − shared) + max(shared).

    A process forked by a worker (``subprocess``, ``multiprocessing``: py-cpuinfo, which
    DeepSpeedCPUAdam calls at construction, forks one) starts with its parent's anonymous pages
    shared copy-on-write, which its ``rss`` counts again; such a process (two levels below another
    of ``pids``) counts its unique pages only (USS, ``/proc/<pid>/smaps_rollup``: read only while
    it exists).

    A compiler an engine starts to build an extension op on first use (DeepSpeed's CPU ops and
    FusedAdam JIT-compile with ninja and a C++/CUDA compiler, deepspeed/ops/op_builder/builder.py
    ``jit_load``) is a one-off of the first run on a machine, not the job's footprint: processes
    named in :data:`BUILD_TOOLS` are not counted (a cold build measured 3.6 GiB per node here).
    """
    import psutil

    pids = list(pids)
    members = set(pids)
    procs = {}
    for pid in pids:
        try:
            procs[pid] = psutil.Process(pid)
        except psutil.Error:
            continue
    private = 0
    shared = 0
    for pid, proc in procs.items():
        try:
            if is_build_tool(proc.name()):
                continue
            parent = proc.ppid()
            grandparent = procs[parent].ppid() if parent in procs else None
            if parent in members and grandparent in members:
                private += int(proc.memory_full_info().uss)
                continue
            info = proc.memory_info()
        except psutil.Error:
            continue
        sh = int(getattr(info, "shared", 0))
        private += int(info.rss) - sh
        shared = max(shared, sh)
    return private + shared


class NodeRssSampler:
    """Samples the node RSS of a process tree every ``interval_s`` in a daemon thread."""

    def __init__(self, pids_fn, *, interval_s: float = 0.05) -> None:
        self._pids_fn = pids_fn
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="zeroplan-node-rss")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pids = list(self._pids_fn())
                if pids:
                    self.samples.append((time.time(), node_rss(pids)))
            except Exception:  # noqa: BLE001 - a sampling hiccup must not stop the probe
                pass
            self._stop.wait(self.interval_s)

    def start(self) -> "NodeRssSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    @property
    def peak_bytes(self) -> int | None:
        return max((b for _, b in self.samples), default=None)

    def phase_peaks(self, starts: dict[str, float]) -> dict[str, int]:
        """Peak node RSS within each phase, phases bounded by their start times (wall clock)."""
        order = sorted((t, name) for name, t in starts.items())
        out: dict[str, int] = {}
        for i, (t0, name) in enumerate(order):
            t1 = order[i + 1][0] if i + 1 < len(order) else float("inf")
            vals = [b for t, b in self.samples if t0 <= t < t1]
            if vals:
                out[name] = max(vals)
        return out

    def at(self, when: float) -> int | None:
        """The first sample at or after ``when`` (the node's footprint at that moment)."""
        return next((b for t, b in self.samples if t >= when), None)


def device_bytes_on_host(est, model=None, *, world_size: int = 1) -> dict[str, int]:
    """On a CPU probe the "device" is host memory too: the device-side bytes per rank at each phase.

    * engine_init: the 16-bit parameters, twice for stages 0-2 (DeepSpeed flattens them into one
      buffer while the originals still exist: stage_1_and_2.py ``flatten_dense_tensors_aligned``),
      plus the fp32 master partition when it stays on the device (created at init).
    * step: the estimator's device peak (``gpu.peak_allocated``, activations included), with
      stages 1-2's reduce buffers counted by their written part only (``torch.empty`` pages are
      resident once written: :func:`~zeroplan.estimator.moments.ipg_buffer_written_elements`),
      which can move the peak to another moment (``model`` given); stages 1-2
      with an offloaded optimizer add the fp32 copy of one parameter's gradient slice that
      stage_1_and_2.py ``async_inplace_copy_grad_to_fp32_buffer_from_gpu`` makes on the device
      (``src_tensor.to(self.master_weights_and_grads_dtype)``) before copying it to the host
      partition: at most the largest parameter or the partition, 4·min(L, s) (``model`` given;
      s = trainable parameters / ``world_size``).
    * checkpoint_save: the device-side model states.
    """
    states = est.states
    plan = est.plan
    init = states.params * (2 if plan.stage < 3 else 1)
    if plan.offload_optimizer == "none":
        # Master weights: 4 of the K bytes per parameter in mixed precision (ZeRO paper §3.1).
        init += states.optimizer_states // 3 if states.optimizer_states else 0
    step = int(est.gpu.peak_allocated)
    if model is not None:
        step -= unwritten_reduce_buffer_bytes(est, model)
    if model is not None and plan.stage in (1, 2) and plan.offload_optimizer != "none":
        from zeroplan.estimator.memory import largest_param_numel

        partition = -(-model.trainable_params // max(1, world_size))
        step += 4 * min(largest_param_numel(model), partition)
    return {"engine_init": init, "step": step, "checkpoint_save": states.total}


def unwritten_reduce_buffer_bytes(est, model) -> int:
    """How much less than ``gpu.peak_allocated`` is resident on a CPU probe because stages 1-2's
    reduce buffers (``ipg_buffers``) are written only in part: the peak taken again over the
    step's moments (``est.moments``) with each buffer at its written elements. 0 when no moment
    holds the buffers or the buffers are filled whole."""
    from zeroplan.estimator.moments import ipg_buffer_written_elements
    from zeroplan.spec import resolve_engine_knobs

    moments = getattr(est, "moments", ())
    buffers = next((m.items["ipg_buffers"] for m in moments if "ipg_buffers" in m.items), 0)
    if not buffers:
        return 0
    plan = est.plan
    bucket = resolve_engine_knobs(plan, model.hidden_size, trainable_params=model.peft and model.trainable_params)[
        "reduce_bucket_size"]
    written = ipg_buffer_written_elements(model, reduce_bucket_size=bucket, overlap_comm=plan.overlap_comm)
    # ipg_buffers = len(written) buffers × bucket elements × bytes per element.
    unwritten = buffers - buffers * sum(written) // (len(written) * bucket)
    peak = max(m.allocated_above_states for m in moments)
    resident = max(m.allocated_above_states - (unwritten if "ipg_buffers" in m.items else 0) for m in moments)
    return peak - resident


def estimated_host(est, model, cluster, training, *, on_cpu: bool, baseline_node: int | None, build: str | None = None,
                   tracker_on: bool = False):
    """The estimator's host phases for a probe: per rank items plus the measured idle footprint.

    ``baseline_node``: the node's RSS when the ranks start running user code (interpreter, torch,
    DeepSpeed and torchrun imported) — a property of the software stack, not of the plan, so it is
    measured and added, not estimated. Returns :class:`zeroplan.estimator.HostPhases` built with
    baseline 0; callers add ``baseline_node`` per node. ``tracker_on``: the CPU memory tracker ran,
    and imported torch._dynamo before the baseline (:class:`zeroplan.runtime.measure.memory.StorageTracker`).
    """
    from zeroplan.estimator import host_phases

    return host_phases(
        model,
        cluster,
        training,
        est.plan,
        device="cpu" if on_cpu else "cuda",
        device_bytes=device_bytes_on_host(est, model, world_size=cluster.gpus) if on_cpu else None,
        baseline_bytes=0,
        build=build if build != "zero_init" or est.plan.stage == 3 else None,
        dynamo_in_baseline=tracker_on,
    )


_DEVICE_OOM = ("CUDA out of memory", "HIP out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "XPU out of memory")


def memory_limit(status: str, error: str | None, memory_kind: str | None) -> str | None:
    """Which memory ran out in an ``oom`` probe: ``device`` (the accelerator's allocator said so),
    else ``host`` (MemoryError, the CPU allocator, ENOMEM under RLIMIT_AS or a cgroup, or the kernel's
    OOM killer's SIGKILL). None unless ``status == "oom"``."""
    if status != "oom":
        return None
    text = error or ""
    if memory_kind == "cuda" and any(s.lower() in text.lower() for s in _DEVICE_OOM):
        return "device"
    return "host"


def summarize_host(ranks: list[dict], sampler: "NodeRssSampler | None") -> dict:
    """Per-rank and per-node host peaks (overall and per phase) from the ranks' reports and the sampler."""
    ranks = sorted(ranks, key=lambda r: r.get("rank", 0))
    out: dict = {
        "model_build": next((r.get("model_build") for r in ranks if r.get("model_build")), None),
        "host_peak_per_rank": [r["host_peak"] for r in ranks if isinstance(r.get("host_peak"), int)],
        "host_phase_peaks_per_rank": [r.get("host_phase_peaks") or {} for r in ranks],
        "pinned_bytes_per_rank": [r.get("pinned_bytes") for r in ranks],
        "host_peak_per_node": None,
        "host_phase_peaks_per_node": {},
        "host_baseline_per_node": None,
    }
    if sampler is None or not sampler.samples:
        return out
    out["host_peak_per_node"] = sampler.peak_bytes
    starts: dict[str, float] = {}
    for r in ranks:
        for name, t in (r.get("host_phase_starts") or {}).items():
            starts[name] = min(starts.get(name, t), t)
    if starts:
        out["host_phase_peaks_per_node"] = sampler.phase_peaks(starts)
        ready = [(r.get("host_phase_starts") or {}).get("model_build") for r in ranks]
        ready = [t for t in ready if t is not None]
        if ready:
            out["host_baseline_per_node"] = sampler.at(max(ready))
    return out
