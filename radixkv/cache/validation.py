"""Argument checks shared by every public entry point: one wording for every size or count."""

from __future__ import annotations

import operator


def check_size(value: object, name: str, *, low: int) -> int:
    """`value` as an int >= low; TypeError for a non-int (bool included), ValueError below `low`."""
    if type(value) is int and value >= low:  # the common case, on every request: one check
        return value
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        number = operator.index(value)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if number < low:
        raise ValueError(f"{name} must be >= {low}, got {number}")
    return number
