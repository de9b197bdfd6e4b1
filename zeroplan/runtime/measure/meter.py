"""Measuring a probe's steps on one rank: the step meter that counts optimizer steps, times the
measured ones and ends the user's loop after the last (:mod:`zeroplan.runtime.rank.worker` runs it)."""

from __future__ import annotations

import dataclasses
import re
import sys
import time

__all__ = ["CPU_MEMORY_STEPS", "PROGRESS_PREFIX", "ProbeDone", "StepMeter", "progress_step"]


class ProbeDone(BaseException):
    """Raised inside the training loop after the last measured step (not an ``Exception``)."""


#: Prefix of the progress lines rank 0 prints to stderr (``zeroplan-progress engine-ready t=S``,
#: ``zeroplan-progress step=N t=S``, S seconds since the worker started); the tuner reads them to
#: tell a failure at start-up from one between steps (``zeroplan.tuner.failures``).
PROGRESS_PREFIX = "zeroplan-progress"

_STEP_LINE = re.compile(rf"{PROGRESS_PREFIX} step=(\d+) ")


def progress_step(line: str) -> int | None:
    """The optimizer step a progress line reports (``zeroplan-progress step=12 t=3.4`` → 12), else None."""
    m = _STEP_LINE.search(line)
    return int(m.group(1)) if m else None


def _progress_printer(rank: int):
    if rank != 0:
        return None
    t0 = time.monotonic()

    def report(event: str) -> None:
        print(f"{PROGRESS_PREFIX} {event} t={time.monotonic() - t0:.3f}", file=sys.stderr, flush=True)

    return report


CPU_MEMORY_STEPS = 2
"""Optimizer steps the CPU memory tracker watches at least (states are created in the first)."""


class StepMeter:
    """Counts optimizer steps; times the ones after warm-up; ends the run after the last.

    With ``target_ci`` (a relative 95% half-width, e.g. 0.05) the meter times micro-steps instead
    (:mod:`zeroplan.runtime.measure.steptime`) and ends the run at the first accumulation boundary where
    the step time's interval is that tight on every rank (``agree`` all-reduces the decision, so
    all ranks stop at the same step), or after ``steps`` optimizer steps' worth of micro-steps.
    Warm-up is then one optimizer step when accumulation is 4 or more (its micro-steps already
    warm the engine), else ``warmup`` steps; the policy's ``extra_warmup`` steps follow, untimed.
    The step time reported is the policy's statistic of the timed steps (both modes).
    """

    def __init__(
        self, *, warmup: int, steps: int, synchronize=None, current_bytes=None, report=None, on_timing_start=None, target_ci=None, agree=None,
        memory_steps: int = 0, policy=None,
    ) -> None:
        from zeroplan.runtime.measure.steptime import PROBE_POLICY

        base = policy or PROBE_POLICY
        self.policy = dataclasses.replace(base, target_ci=target_ci if target_ci is not None else base.target_ci, max_steps=steps,
                                          min_steps=min(base.min_steps, steps))
        """What the probe reports and when it stops (:class:`zeroplan.runtime.measure.steptime.MeasurePolicy`):
        its statistic serves both modes; the stop rule the micro-step mode; ``steps`` is the most."""
        self.warmup = warmup
        self.memory_steps = memory_steps
        """Optimizer steps a memory tracker that ends with warm-up must see (micro-step mode too)."""
        self.steps = steps
        self.count = 0
        self.samples_per_step: int | None = None
        self.step_times: list[float] = []
        self.step_cpu_times: list[float] = []
        """CPU seconds this process spent per timed step (all its threads): on a shared machine less
        disturbed by other jobs than wall time."""
        self._last_cpu: float | None = None
        self._synchronize = synchronize or (lambda: None)
        self._last: float | None = None
        self.started = False
        self._current_bytes = current_bytes
        self.state_bytes: int | None = None
        """Live bytes just before the last optimizer step measured for memory (the last warm-up
        step when warm-up ends the memory tracking): after backward, so activations are freed and
        parameters, gradients, optimizer states and engine buffers remain."""
        self._report = report or (lambda event: None)
        self._on_timing_start = on_timing_start
        self._tracking = True
        self.target_ci = target_ci
        """Relative 95% half-width at which a micro-step measurement stops (None: time whole steps)."""
        self._agree = agree or (lambda done: done)
        self.grad_accum = 1
        """Micro-steps per optimizer step (set by the engine wrapper)."""
        self.micro_times: list[float] = []
        self.boundary_times: list[float] = []
        self.micro_cpu_times: list[float] = []
        """CPU seconds of every timed micro-step, in order (boundary ones included)."""
        self._last_micro_cpu: float | None = None
        self.estimate = None

    def report(self, event: str) -> None:
        """Print a progress event (rank 0; the others print nothing)."""
        self._report(event)

    def start(self) -> None:
        """Called when the engine exists (timing of step 1 starts here when warmup is 0)."""
        self.started = True
        self._report("engine-ready")
        if self._warmup_steps == 0:
            self._report("measuring")
            self._synchronize()
            self._last = time.perf_counter()
            self._last_cpu = self._last_micro_cpu = time.process_time()

    @property
    def micro_mode(self) -> bool:
        return self.target_ci is not None

    @property
    def _warmup_steps(self) -> int:
        if self.micro_mode and self.grad_accum >= 4:
            return min(self.warmup, max(1, self.memory_steps)) + self.policy.extra_warmup
        return self.warmup + (self.policy.extra_warmup if self.micro_mode else 0)

    def before_optimizer_step(self) -> None:
        """Called after the last backward of a step, before the optimizer runs."""
        if self._current_bytes is not None and self._tracking:
            self.state_bytes = self._current_bytes()

    def optimizer_step_done(self) -> None:
        self.count += 1
        if self.count < self.warmup:
            self._report(f"step={self.count}")
            return
        if self.count == self.warmup:
            self._report("measuring")
        if self.count == self.warmup and self._on_timing_start is not None:
            # Memory has seen build, engine init and every warm-up step (the first optimizer step,
            # where lazy optimizer states appear, included); the timed steps run untouched by it.
            self._on_timing_start()
            self._tracking = False
        self._synchronize()
        now = time.perf_counter()
        cpu_now = time.process_time()
        if self.count > self.warmup and self._last is not None:
            self.step_times.append(now - self._last)
            if self._last_cpu is not None:
                self.step_cpu_times.append(cpu_now - self._last_cpu)
        self._report(f"step={self.count}")
        self._last = time.perf_counter()  # the report's own time is not the next step's
        self._last_cpu = time.process_time()
        if self.count >= self.warmup + self.steps:
            raise ProbeDone()

    def micro_step_done(self, boundary: bool) -> None:
        """Micro-step mode: called after every micro-step (``boundary``: it ran the optimizer)."""
        from zeroplan.runtime.measure.steptime import estimate_step_time

        if self.count >= self._warmup_steps and self._last is not None:
            self._synchronize()
            dt = time.perf_counter() - self._last
            cpu = time.process_time()
            (self.boundary_times if boundary else self.micro_times).append(dt)
            if self._last_micro_cpu is not None:
                self.micro_cpu_times.append(cpu - self._last_micro_cpu)
            if boundary and self._last_cpu is not None:
                self.step_cpu_times.append(cpu - self._last_cpu)
        if not boundary:
            self._last = time.perf_counter()
            self._last_micro_cpu = time.process_time()
            return
        self.count += 1
        self._report(f"step={self.count}")
        if self.count < self._warmup_steps:
            return
        if self.count == self._warmup_steps:
            self._report("measuring")
        if self.count == self._warmup_steps and self._on_timing_start is not None:
            self._on_timing_start()  # as in optimizer_step_done: memory tracking ends with warm-up
            self._tracking = False
        self.estimate = estimate_step_time(self.micro_times, self.boundary_times, self.grad_accum, self.policy.statistic)
        if self.estimate is not None:
            self.step_times = [self.estimate.step_time_s]
        done = self.policy.done(self.estimate, len(self.boundary_times))
        if self.count > self._warmup_steps or self._warmup_steps == 0:
            done = self._agree(done)
        else:
            done = False  # the boundary that ends warm-up
        self._synchronize()
        self._last = time.perf_counter()  # the agreement's collective is not the next micro-step's
        self._last_cpu = self._last_micro_cpu = time.process_time()
        if done:
            if self.estimate is not None:
                self._report(
                    f"measured step_time={self.estimate.step_time_s:.6f} ci={self.estimate.half_width_s:.6f} micro={self.estimate.micro_steps}"
                )
            raise ProbeDone()

    @property
    def measured(self) -> int:
        if self.micro_mode:
            return max(1, (len(self.micro_times) + len(self.boundary_times)) // self.grad_accum) if self.boundary_times else 0
        return len(self.step_times)

    @property
    def step_time(self) -> float | None:
        """Seconds per optimizer step: the micro-step estimate, or the policy's statistic of the timed steps."""
        from zeroplan.runtime.measure.steptime import step_statistic

        if not self.step_times:
            return None
        return self.step_times[0] if self.micro_mode else step_statistic(self.step_times, self.policy.statistic)

    def as_dict(self) -> dict:
        out = {
            "steps": self.measured,
            "optimizer_steps": self.count,
            "step_times": self.step_times,
            "step_cpu_times": self.step_cpu_times,
            "step_time": self.step_time,
            "samples_per_step": self.samples_per_step,
            "state_memory": self.state_bytes,
        }
        if self.estimate is not None:
            out |= {"step_time_ci": self.estimate.half_width_s, "micro_steps": self.estimate.micro_steps}
        if self.micro_mode:
            out |= {"micro_times": self.micro_times, "boundary_times": self.boundary_times, "micro_cpu_times": self.micro_cpu_times}
        return out


def _agreement(world_size: int):
    """All ranks stop together: True only if every rank is done (an all-reduce MIN of one flag)."""
    if world_size <= 1:
        return None

    def agree(done: bool) -> bool:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return done
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        flag = torch.tensor([1 if done else 0], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    return agree
