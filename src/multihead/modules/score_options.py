"""Shared score options of the attention layer: ``alibi`` and ``softcap``.

``AttentionLayer`` takes them once for every kind whose core is
``functional.attention`` (the base ``core``):

* ``alibi``: False; True (BLOOM's slopes for the layer's H heads,
  ``functional.alibi_slopes``); or H floats, one slope per head. Head h adds
  -m_h·|i - j| to its scores, queries placed among the keys as the call's
  causal alignment places them (with a self-attention cache the default
  bottom-right alignment puts the T new queries after the cached keys).
  The slopes are a buffer ``alibi_slopes`` [H] (float32, not in the
  state dict); ``select_heads`` keeps the kept heads' slopes.
* ``softcap``: None or c > 0: scaled scores x become c·tanh(x / c) before
  the bias and masking (Gemma 2).

A kind that cannot take one names it in ``refused_options`` and may give its
reason in a class attribute ``option_refusals`` (option name -> sentence); a
value for it is a TypeError naming both.
"""

from __future__ import annotations

import math
import numbers
from contextlib import contextmanager

import torch

from ..functional import alibi_slopes

__all__ = ["refuse_options", "init_score_options", "keep_head_slopes", "rebuilt_without_slopes"]


def refuse_options(layer, given: dict) -> None:
    """TypeError for the shared options ``given`` (name -> value, None = not given)
    that the layer's kind refuses, with each reason the kind gives."""
    cls = type(layer)
    refused = {n: v for n, v in given.items() if n in cls.refused_options and v is not None}
    if refused:
        why_not = getattr(cls, "option_refusals", {})
        reasons = [why_not[n] for n in refused if n in why_not]
        why = f": {'; '.join(reasons)}" if reasons else ""
        raise TypeError(f"{cls.__name__} does not take {', '.join(refused)} (got {refused}){why}")


def _slopes(alibi: object, H: int) -> tuple[float, ...] | None:
    if alibi is False or alibi is None:
        return None
    if alibi is True:
        with torch.device("cpu"):  # numbers, also while a model is built under torch.device("meta")
            return tuple(alibi_slopes(H, dtype=torch.float64).tolist())
    if isinstance(alibi, (str, bytes)) or not hasattr(alibi, "__len__"):
        raise TypeError(f"alibi must be a bool or a list of {H} slopes, got alibi={alibi!r}")
    values = list(alibi.tolist() if isinstance(alibi, torch.Tensor) else alibi)
    if len(values) != H or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
                                   for x in values):  # fmt: skip
        raise ValueError(f"alibi slopes must be {H} finite numbers (one per head), got alibi={values!r}")
    return tuple(float(x) for x in values)


def init_score_options(layer, alibi: object, softcap: object) -> None:
    """Check the options and set ``layer.alibi_slopes`` (buffer [H] or None),
    ``layer.softcap`` and their ``init_options`` entries.

    Raises:
        TypeError / ValueError: alibi not a bool or H finite slopes, softcap
            not None or a positive finite number.
    """
    slopes = _slopes(alibi, layer.num_heads)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not math.isfinite(softcap) or softcap <= 0):  # fmt: skip
        raise ValueError(f"softcap must be None or a positive finite number, got softcap={softcap!r}")
    layer.softcap = None if softcap is None else float(softcap)
    _set_slopes(layer, slopes)
    layer.init_options.update(alibi=alibi if slopes is None or alibi is True else list(slopes), softcap=softcap)


def _set_slopes(layer, slopes: tuple[float, ...] | None) -> None:
    tensor = None
    if slopes is not None:
        device = layer.factory["device"]
        tensor = torch.tensor(slopes, dtype=torch.float32, device=device)
    layer.register_buffer("alibi_slopes", tensor, persistent=False)


@contextmanager
def rebuilt_without_slopes(layer):
    """While a kind rebuilds itself for fewer heads (``subset_heads`` from its
    ``init_options``), its ``alibi`` option reads False: a list of H slopes fits
    no other head count. ``keep_head_slopes`` then gives the kept heads theirs."""
    if "alibi" not in layer.init_options:
        yield
        return
    saved = layer.init_options["alibi"]
    layer.init_options["alibi"] = False
    try:
        yield
    finally:
        layer.init_options["alibi"] = saved


def keep_head_slopes(new, old, heads: list[int]):
    """``new`` (``old`` reduced to ``heads``) with the kept heads' slopes."""
    if old.alibi_slopes is not None:
        if old.alibi_slopes.is_meta:  # a layer built on the meta device: its numbers are in its options
            slopes = list(_slopes(old.init_options["alibi"], old.num_heads))
        else:
            slopes = old.alibi_slopes.detach().cpu().tolist()
        kept = [slopes[h] for h in heads]
        new.register_buffer("alibi_slopes", torch.tensor(kept, dtype=torch.float32,
                            device=old.alibi_slopes.device), persistent=False)  # fmt: skip
        new.init_options["alibi"] = kept
    return new
