"""Argument checks shared by every layer of the package.

User errors raise TypeError (wrong kind of value) or ValueError (wrong
value) with the offending value in the message; never ``assert``, which
``python -O`` removes.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["positive_int", "non_negative_int", "dropout_probability", "divisible"]


def _integer(name: str, value: object, kind: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a {kind} int, got {name}={value!r} ({type(value).__name__})")
    return int(value)


def positive_int(name: str, value: object) -> int:
    """Return ``value`` as an int >= 1.

    Raises:
        TypeError: not an int (bools are refused).
        ValueError: zero or negative.
    """
    value = _integer(name, value, "positive")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return value


def non_negative_int(name: str, value: object) -> int:
    """Return ``value`` as an int >= 0 (a length may be zero)."""
    value = _integer(name, value, "non-negative")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {name}={value!r}")
    return value


def dropout_probability(value: object, name: str = "dropout") -> float:
    """Return ``value`` as a float in [0, 1).

    Raises:
        ValueError: a bool, a non-number, NaN, or outside [0, 1) (p = 1 would
            zero every weight and rescale by infinity).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a float in [0, 1), got {name}={value!r}")
    p = float(value)
    if math.isnan(p) or not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {name}={value!r}")
    return p


def divisible(total: int, parts: int, total_name: str, parts_name: str) -> None:
    """Raise ValueError unless ``parts`` divides ``total``, naming both."""
    if total % parts != 0:
        raise ValueError(
            f"{total_name} must be divisible by {parts_name}, got {total_name}={total} and "
            f"{parts_name}={parts} ({total_name} % {parts_name} = {total % parts})"
        )
