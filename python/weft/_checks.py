"""Argument checks of weft's Python layer, before values cross into C++: no silent coercion
(1.5, "2" and True are no ints; "1" is no number), names that C++ can take (str, encodable as
UTF-8), and integers within the range of the C++ field they fill. A wrong type raises TypeError,
a value out of range or a name that is not valid UTF-8 raises weft.Error; both name the field."""

from __future__ import annotations

import numbers

from ._weft import Error

INT32 = (-2**31, 2**31 - 1)
UINT64 = (0, 2**64 - 1)


def integer(value, field: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{field} must be an int, got {type(value).__name__}: {value!r}")
    if not lo <= value <= hi:
        raise Error(f"{field} {value} is outside [{lo}, {hi}]")
    return int(value)


def number(value, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{field} must be a number, got {type(value).__name__}: {value!r}")
    return float(value)


def boolean(value, field: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{field} must be a bool, got {type(value).__name__}: {value!r}")
    return value


def name(value, field: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} must be a str, got {type(value).__name__}: {value!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Error(f"{field} {value!r} is not valid UTF-8 (a lone surrogate at {e.start})") \
            from None
    return value
