"""Per-plan work computed once for the plans that differ only in fields the work does not read.

An estimate's plans vary stage, offloads, checkpointing and micro-batch; the host's buffers, the
engine's extra allocations and the bytes communicated do not depend on the micro-batch (only the
activations and the step time do: ``plan.micro_batch`` is read in ``activations.py``, ``timing.py``
and ``plans.py`` alone), so the 196 plans of ``estimate --params 175e9 --gpus 64`` share a few
dozen of each. A :class:`PlanCache` keys a function of (model, cluster, training, plan, options)
on every plan field but the ones it is told the function ignores — a field added later keys it
too — and on the specs by identity (a cluster holds dicts, so it has no hash); each entry keeps
its specs alive, so an identity is not reused while the entry exists. Results are shared between
plans: read them, do not change them.
"""

from __future__ import annotations

from dataclasses import fields
from operator import attrgetter
from typing import Any, Callable

from zeroplan.spec import Plan

__all__ = ["PlanCache"]


class PlanCache:
    """``function(model, cluster, training, plan, **options)``, once per key (see the module docstring)."""

    def __init__(self, function: Callable[..., Any], *, ignores: frozenset[str], size: int = 4096) -> None:
        unknown = ignores - {f.name for f in fields(Plan)}
        if unknown:
            raise ValueError(f"ignores names no Plan field: {sorted(unknown)}")
        self.function = function
        self.ignores = ignores
        self.keyed_fields = tuple(f.name for f in fields(Plan) if f.name not in ignores)
        # One C-level call reads every keyed field (a generator of getattr calls cost as much as
        # the work it saved for the cheaper functions).
        self._plan_key = attrgetter(*self.keyed_fields)
        self.size = size
        self._entries: dict[tuple, tuple[Any, Any, Any, Any]] = {}

    def __call__(self, model: Any, cluster: Any, training: Any, plan: Plan, **options: Any) -> Any:
        # Options in the caller's keyword order: one call site always gives the same order (another
        # order only misses the cache).
        key = (id(model), id(cluster), id(training), self._plan_key(plan), tuple(options.items()))
        found = self._entries.get(key)
        if found is not None and found[0] is model and found[1] is cluster and found[2] is training:
            return found[3]
        if len(self._entries) >= self.size:
            self._entries.clear()
        value = self.function(model, cluster, training, plan, **options)
        self._entries[key] = (model, cluster, training, value)
        return value
