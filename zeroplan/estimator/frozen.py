"""Frozen dataclass instances built without the generated ``__init__``, for the per-plan results.

A frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (the class's own
``__setattr__`` refuses): for :class:`~zeroplan.estimator.plan_estimate.GpuMemory`'s nine fields
2.1–2.6 µs, against 1.6 µs to hand the instance the call's keyword dictionary as its ``__dict__``
(CPython 3.11, a loaded 2-core machine, 2026-12-02). An estimate builds eight such results for
every plan (the memory, the verdict and its two sides, the step time and its overlap, the
allocator's reserve, the estimate itself). The instance is the same: same class, same fields
(equality, hashing, ``repr``, ``dataclasses.replace`` and ``asdict`` read them in the fields'
order as before; only ``vars()`` lists them in the caller's order), still frozen. Only for classes
without ``__post_init__`` (nothing would check it) and without ``__slots__``.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, TypeVar

__all__ = ["built", "once"]

T = TypeVar("T")

#: class -> (field count, field names as a set, plain defaults, (name, factory) of the fields with a default_factory).
_SHAPES: dict[type, tuple[int, frozenset[str], dict[str, Any], tuple[tuple[str, Any], ...]]] = {}
_set_attribute = object.__setattr__


def _shape(cls: type) -> tuple[int, frozenset[str], dict[str, Any], tuple[tuple[str, Any], ...]]:
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        raise TypeError(f"{cls.__name__}: built() skips __post_init__ and needs an instance __dict__")
    fs = fields(cls)
    shape = (
        len(fs),
        frozenset(f.name for f in fs),
        {f.name: f.default for f in fs if f.default is not MISSING},
        tuple((f.name, f.default_factory) for f in fs if f.default_factory is not MISSING),
    )
    _SHAPES[cls] = shape
    return shape


def built(cls: type[T], /, **values: Any) -> T:
    """``cls(**values)`` for a frozen dataclass ``cls``: ``values`` (a new dictionary, this call's
    own) becomes the instance's ``__dict__``, defaults added for the fields not given.

    TypeError, as ``cls(**values)`` would raise, when a field without a default is missing or a
    name is not a field. Given every field, only their count is checked (a misspelt name then
    stands for a missing one: tests/test_frozen.py checks every result an estimate builds)."""
    count, every, defaults, factories = _SHAPES.get(cls) or _shape(cls)
    if len(values) != count:
        values = {**defaults, **{name: factory() for name, factory in factories if name not in values}, **values}
        if values.keys() != every:
            missing = sorted(every - values.keys())
            unknown = [n for n in values if n not in every]
            raise TypeError(f"{cls.__name__}: missing {missing}, unknown {unknown}")
    obj = object.__new__(cls)
    _set_attribute(obj, "__dict__", values)
    return obj


class once:
    """``functools.cached_property`` without its lock: the value is computed on first access and
    kept in the instance's ``__dict__`` (which later reads find first). Python 3.11's
    ``cached_property`` takes an ``RLock`` on every first access (removed in 3.12, cpython
    gh-87634), ~2 µs; the estimator's timelines and host phases, made anew for each group of plans
    that share them, read ~12,000 such values in the sweep. Two threads computing the same value
    at once both compute it (the results are equal: pure functions of frozen fields)."""

    def __init__(self, function: Any) -> None:
        self.function = function
        self.name = function.__name__
        self.__doc__ = function.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.function(instance)
        return value
