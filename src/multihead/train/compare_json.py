"""The JSON files of ``multihead compare`` are strict JSON: a NaN or infinite
number (the loss of a run that diverged) is written as ``null``.

    strict({"val_loss": nan, "curve": [[1, 2.5], [2, inf]]})
        -> {"val_loss": None, "curve": [[1, 2.5], [2, None]]}
    dumps(value)   json.dumps(strict(value), allow_nan=False)
    loss(None)     -> nan    (a loss read back: null is a loss that is not finite)
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["strict", "dumps", "loss"]


def strict(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None (dicts, lists, tuples walked)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """Strict JSON text of ``value`` (``json.dumps`` keywords pass through)."""
    return json.dumps(strict(value), allow_nan=False, **kwargs)


def loss(value: float | None) -> float:
    """A loss read back from strict JSON: null is NaN."""
    return math.nan if value is None else float(value)
