"""The one exception type for bad input anywhere in zeroplan."""

from __future__ import annotations

import math

__all__ = ["SpecError", "check_positive_int", "check_positive_float", "check_choice"]


class SpecError(ValueError):
    """A value that cannot be used, with a message naming the field, the value and what is valid.

    The CLI turns it into one line on stderr and exit code 2.
    """


def check_positive_int(name: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> None:
    """Raise SpecError unless ``value`` is an int in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{name}={value!r} is not an integer; give a whole number >= {minimum}")
    if value < minimum:
        raise SpecError(f"{name}={value} is too small; it must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{name}={value} is absurdly large; it must be <= {maximum:.3g}")


def check_positive_float(
    name: str, value: object, *, minimum: float = 0.0, maximum: float | None = None, allow_zero: bool = False
) -> None:
    """Raise SpecError unless ``value`` is a finite number > minimum (>= if allow_zero)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(f"{name}={value!r} is not a number")
    if math.isnan(value) or math.isinf(value):
        raise SpecError(f"{name}={value} is not finite; give a finite positive number")
    if value < minimum or (value == minimum and not allow_zero):
        op = ">=" if allow_zero else ">"
        raise SpecError(f"{name}={value:g} is out of range; it must be {op} {minimum:g}")
    if maximum is not None and value > maximum:
        raise SpecError(f"{name}={value:g} is absurdly large; it must be <= {maximum:.3g}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """Raise SpecError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise SpecError(f"{name}={value!r} is not valid; choose one of {', '.join(choices)}")
