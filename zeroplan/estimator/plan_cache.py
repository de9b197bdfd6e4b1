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

_MISSING = object()


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
        self._count = 0
        #: (id(model), id(cluster), id(training)) -> (model, cluster, training, {plan key: value}).
        self._by_specs: dict[tuple[int, int, int], tuple[Any, Any, Any, dict[tuple, Any]]] = {}
        # The specs of the last call and their entries: an estimate asks for one model, cluster
        # and training spec many times in a row, so most calls skip the lookup by identity.
        self._last: tuple[Any, Any, Any, dict[tuple, Any]] = (None, None, None, {})

    def _entries_for(self, model: Any, cluster: Any, training: Any) -> dict[tuple, Any]:
        specs = (id(model), id(cluster), id(training))
        found = self._by_specs.get(specs)
        if found is None or found[0] is not model or found[1] is not cluster or found[2] is not training:
            found = (model, cluster, training, {})
            self._by_specs[specs] = found
        self._last = found
        return found[3]

    def __call__(self, model: Any, cluster: Any, training: Any, plan: Plan, **options: Any) -> Any:
        last = self._last
        if last[0] is model and last[1] is cluster and last[2] is training:
            entries = last[3]
        else:
            entries = self._entries_for(model, cluster, training)
        # Options in the caller's keyword order: one call site always gives the same order (another
        # order only misses the cache).
        key = (self._plan_key(plan), tuple(options.items()))
        value = entries.get(key, _MISSING)
        if value is not _MISSING:
            return value
        if self._count >= self.size:
            self._by_specs.clear()
            self._count = 0
            entries = self._entries_for(model, cluster, training)
        value = self.function(model, cluster, training, plan, **options)
        entries[key] = value
        self._count += 1
        return value
