"""Where a probe's wall time goes: the phases the launcher sees, from the worker's progress lines.

The worker (rank 0) prints ``zeroplan-progress EVENT t=S`` lines (zeroplan.runtime.measure.meter); the
launcher notes when each reached it, on its own clock, so the time before the worker ran (the
launcher's start, torchrun's or a fork) is counted too.
"""

from __future__ import annotations

import time
from typing import Callable

__all__ = ["PHASES", "PhaseClock"]


#: Wall-time phases of a probe, in order (``ProbeResult.phases_s``): ``server`` the warm server's
#: start (imports paid once per session, on the probe that started it), ``launch`` until the
#: worker's first line (torchrun's own start and the worker interpreter's, or a fork), ``imports``
#: torch and DeepSpeed in the worker, ``script`` the user's code until ``deepspeed.initialize``
#: (script import, process group, model build), ``engine`` the engine build, ``warmup`` the
#: unmeasured steps, ``measure`` the measured ones, ``teardown`` the last step to the job's exit,
#: ``report`` reading the ranks' results, the estimate and the files.
PHASES = ("server", "launch", "imports", "script", "engine", "warmup", "measure", "teardown", "report")
_EVENT_PHASE_END = {"worker-start": "launch", "imported": "imports", "initialize": "script", "engine-ready": "engine", "measuring": "warmup"}


class PhaseClock:
    """When each progress event reached the launcher (its clock, so the launch is included)."""

    def __init__(self, started: float, on_line: Callable[[str], None] | None) -> None:
        self.started = started
        self.marks: dict[str, float] = {}
        self.last_step: float | None = None
        self._on_line = on_line

    def mark(self, name: str, *, at: float | None = None) -> None:
        """Note that ``name`` happened (now, or at ``at`` on the monotonic clock); the first note stays."""
        self.marks.setdefault(name, time.monotonic() if at is None else at)

    def on_line(self, line: str) -> None:
        # A progress line can follow a progress bar's carriage-return line (Trainer's tqdm) on one line.
        at = line.find("zeroplan-progress ")
        if at >= 0:
            event = line[at:].split()[1]
            if event in _EVENT_PHASE_END:
                self.mark(event)
            elif event.startswith("step=") or event == "measured":
                self.last_step = time.monotonic()
        if self._on_line is not None:
            self._on_line(line)

    def phases(self) -> dict[str, float]:
        """Seconds per phase the probe reached; a phase without its events is left out."""
        ends = [("server", self.marks.get("launch"))]
        ends += [(phase, self.marks.get(event)) for event, phase in _EVENT_PHASE_END.items()]
        ends += [("measure", self.last_step if "measuring" in self.marks else None), ("teardown", self.marks.get("exit")), ("report", self.marks.get("report"))]
        out: dict[str, float] = {}
        previous = self.started
        for phase, end in ends:
            if end is None or end < previous:
                continue
            out[phase] = round(end - previous, 3)
            previous = end
        return out
