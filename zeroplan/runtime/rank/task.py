"""A zeroplan task (``zeroplan_task()`` returning a :class:`Task`) and its one loader, defined in
:mod:`zeroplan.spec.task` so that every layer that runs or reads a task (the probe worker, the
tuner, the tracer, calibration) loads it the same way; importable from here as before."""

from __future__ import annotations

from zeroplan.spec.task import NotATask, Task, load_task

__all__ = ["NotATask", "Task", "load_task"]
