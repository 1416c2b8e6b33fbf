"""How many examples the hypothesis properties draw.

Each property names its count for ``make test``; ``MULTIHEAD_PROPERTY_SCALE=K``
multiplies every count by K for a longer hunt, and then the derandomized ones
draw fresh examples too::

    MULTIHEAD_PROPERTY_SCALE=50 python -m pytest tests/functional/test_properties.py
"""

from __future__ import annotations

import os

__all__ = ["examples", "derandomized", "SCALE"]


def _scale() -> int:
    text = os.environ.get("MULTIHEAD_PROPERTY_SCALE", "1")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"MULTIHEAD_PROPERTY_SCALE must be a positive int, got {text!r}")
    return int(text)


SCALE = _scale()


def examples(n: int) -> int:
    """``n`` examples, times ``MULTIHEAD_PROPERTY_SCALE``."""
    return n * SCALE


def derandomized() -> bool:
    """Whether the properties that fix their examples keep them fixed (not in a longer hunt)."""
    return SCALE == 1
