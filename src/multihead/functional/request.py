"""Validation of an attention call into one normalised request.

Every backend receives an ``AttentionRequest`` whose tensors have already
been checked, so backends contain only computation. The mask is split into
two parts that all backends read the same way:

* ``allowed``: bool, broadcastable to (B, H, T, S), True = may attend, or
  None when every key is visible (before causality is applied);
* ``bias``: float, broadcastable to (B, H, T, S), added to the scores, or
  None. Entries of -inf in a float mask are moved into ``allowed`` so that
  they are excluded with ``where`` and not by addition.

Weights are asked for with ``return_weights``: True (every weight,
differentiable where the inputs need gradients) or a ``WeightSelection``
(some heads and rows, detached), resolved here into ``weight_heads`` and
``weight_rows`` (ascending indices, None = all).

Two score modifications travel as fields, not as masks, so each backend
serves them its own way (``math`` exactly, ``sdpa`` ALiBi as an added bias,
``flex`` both in its score function):

* ``softcap``: c·tanh(x / c) of the scaled scores x (Gemma 2), before the
  bias, ALiBi and masking;
* ``alibi_slopes``: (H,), adding -m_h·|i + offset - j| with the
  queries placed among the keys by ``causal_alignment`` (offset 0
  top-left, S - T bottom-right: decoding with a cache).

``sinks`` [H] (or None): one learned logit per query head, an extra column
of every row's softmax that mixes no value (``functional.sinks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._checks import dropout_probability
from . import host_sync
from .masks import causal_mask, check_alignment
from .weights import WeightSelection, resolve_selection

__all__ = ["AttentionRequest", "make_request"]


@dataclass(frozen=True)
class AttentionRequest:
    """A validated attention call. Shapes: q (B, H, T, D), k (B, G, S, D),
    v (B, G, S, Dv); allowed / bias broadcast to (B, H, T, S). The weights
    asked for are those of query heads ``weight_heads`` and query rows
    ``weight_rows`` (None: all), detached when ``weights_detached``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    allowed: torch.Tensor | None
    bias: torch.Tensor | None
    is_causal: bool
    causal_alignment: str
    scale: float
    dropout_p: float
    return_weights: bool
    weight_heads: tuple[int, ...] | None = None
    weight_rows: tuple[int, ...] | None = None
    weights_detached: bool = False
    alibi_slopes: torch.Tensor | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def alibi_offset(self) -> int:
        """Position of query 0 among the keys for ALiBi (and causality)."""
        _, _, _, T, S, _ = self.shape
        return 0 if self.causal_alignment == "top_left" else S - T

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        """(B, H, G, T, S, Dv)."""
        B, H, T, _ = self.q.shape
        G, S, Dv = self.k.shape[1], self.k.shape[2], self.v.shape[3]
        return B, H, G, T, S, Dv

    @property
    def weights_need_grad(self) -> bool:
        """True when the returned weights must carry gradients: all of them were
        asked for (not a detached selection) and an input requires grad."""
        if not self.return_weights or self.weights_detached or not torch.is_grad_enabled():
            return False
        return any(t is not None and t.requires_grad for t in (self.q, self.k, self.v, self.bias, self.sinks))

    @property
    def causal_is_trivial(self) -> bool:
        """True when causality hides no key (or there is no causality)."""
        _, _, _, T, S, _ = self.shape
        if not self.is_causal or T == 0 or S == 0:
            return True
        if self.causal_alignment == "bottom_right":
            return T == 1
        return S == 1

    def visible(self) -> torch.Tensor | None:
        """The effective "may attend" mask: ``allowed`` AND causality.

        Returns:
            bool broadcastable to [B, H, T, S], or None when every key is visible.
        """
        _, _, _, T, S, _ = self.shape
        allowed = self.allowed
        if not self.causal_is_trivial:
            causal = causal_mask(T, S, alignment=self.causal_alignment, device=self.q.device)
            causal = causal[None, None]  # (T, S) -> (1, 1, T, S)
            allowed = causal if allowed is None else allowed & causal
        return allowed


def _shapes(**tensors: torch.Tensor) -> str:
    return ", ".join(f"{n}={tuple(t.shape)}" for n, t in tensors.items())


def _check_qkv(q: object, k: object, v: object) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if not (q.dim() == k.dim() == v.dim() == 4):
        raise ValueError(
            "q, k, v must be 4-D: q (B, H, T, D), k (B, G, S, D), v (B, G, S, Dv); "
            f"got {_shapes(q=q, k=k, v=v)}"
        )
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    B, H, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: {_shapes(q=q, k=k, v=v)}")
    G = k.shape[1]
    if v.shape[1] != G:
        raise ValueError(f"k and v head counts differ: {_shapes(k=k, v=v)}")
    if G < 1 or G > H or H % G != 0:
        raise ValueError(
            f"key/value heads G={G} must divide query heads H={H} (1 <= G <= H): "
            f"{_shapes(q=q, k=k, v=v)}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"key and value lengths differ: {_shapes(k=k, v=v)}")
    if k.shape[3] != D:
        raise ValueError(f"q and k head dims differ: {_shapes(q=q, k=k)}")


def _check_sinks(sinks: object, q: torch.Tensor) -> None:
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise TypeError(f"sinks must be a floating torch.Tensor [H] or None, got {getattr(sinks, 'dtype', type(sinks))}")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must be [H] = [{q.shape[1]}] (one logit per query head), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}")


def _normalise_mask(
    mask: object, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Split a user mask into (allowed, bias); see the module docstring."""
    if mask is None:
        return None, None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(
            f"attn_mask must be bool (True = may attend) or floating (added to the "
            f"scores), got dtype {mask.dtype}"
        )
    if mask.device != q.device:
        raise ValueError(f"attn_mask is on {mask.device} but q is on {q.device}")
    B, H, T, _ = q.shape
    S = k.shape[2]

    def accepted() -> str:
        # Formatted only on error: formatting a size fixes it to its value inside torch.compile.
        return f"accepted: (T, S) = ({T}, {S}) or 4-D broadcastable to (B, H, T, S) = ({B}, {H}, {T}, {S})"

    if mask.dim() == 2:
        if tuple(mask.shape) != (T, S):
            raise ValueError(f"2-D attn_mask must be (T, S); got {tuple(mask.shape)}; {accepted()}")
        mask = mask[None, None]  # (T, S) -> (1, 1, T, S)
    elif mask.dim() == 4:
        for got, want in zip(mask.shape, (B, H, T, S)):
            if got != 1 and got != want:  # not `in`: symbolic sizes under torch.compile
                raise ValueError(f"attn_mask shape {tuple(mask.shape)} does not broadcast; {accepted()}")
    else:
        raise ValueError(f"attn_mask must be 2-D or 4-D, got shape {tuple(mask.shape)}; {accepted()}")
    if mask.dtype == torch.bool:
        return mask, None
    bias = mask.to(q.dtype) if q.dtype not in (torch.float16, torch.bfloat16) else mask.float()
    neg_inf = torch.isneginf(bias)
    # Eager code looks (a host read) and keeps a mask without -inf as a pure
    # bias; compiled code always splits, which gives the same numbers.
    if host_sync.sync_free() or bool(neg_inf.any()):
        return ~neg_inf, bias.masked_fill(neg_inf, 0.0)
    return None, bias


def make_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    causal_alignment: str,
    scale: float | None,
    dropout_p: float,
    training: bool,
    return_weights: bool | WeightSelection,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> AttentionRequest:
    """Validate an attention call and return the normalised request.

    Raises:
        TypeError: non-tensor or non-floating inputs, integer masks.
        ValueError: shapes, dtypes, devices, mask shapes, scale, dropout_p,
            causal_alignment, a weight selection outside the call's heads or
            rows, ALiBi slopes that are not (H,), a softcap that is not a
            positive finite float, sinks that are not a floating [H] tensor
            on q's device; messages name the offending values.
    """
    _check_qkv(q, k, v)
    if sinks is not None:
        _check_sinks(sinks, q)
    check_alignment(causal_alignment)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    p = dropout_probability(dropout_p, "dropout_p")
    if scale is None:
        D = q.shape[-1]
        scale = 1.0 / math.sqrt(D) if D > 0 else 1.0
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    allowed, bias = _normalise_mask(attn_mask, q, k)
    slopes = _check_slopes(alibi_slopes, q)
    cap = _check_softcap(softcap)
    heads = rows = None
    selected = isinstance(return_weights, WeightSelection)
    if selected:
        heads, rows = resolve_selection(return_weights, q.shape[1], q.shape[2])
    return AttentionRequest(
        q=q,
        k=k,
        v=v,
        allowed=allowed,
        bias=bias,
        is_causal=is_causal,
        causal_alignment=causal_alignment,
        scale=float(scale),
        dropout_p=p if training else 0.0,
        return_weights=selected or bool(return_weights),
        weight_heads=heads,
        weight_rows=rows,
        weights_detached=selected,
        alibi_slopes=slopes,
        softcap=cap,
        sinks=sinks,
    )


def _check_slopes(slopes: object, q: torch.Tensor) -> torch.Tensor | None:
    """(H,) slopes on q's device (float64 for float64 inputs, else float32), or None."""
    if slopes is None:
        return None
    if not isinstance(slopes, torch.Tensor) or not slopes.dtype.is_floating_point:
        raise TypeError(f"alibi_slopes must be a floating torch.Tensor (H,), got {getattr(slopes, 'dtype', type(slopes))}")
    H = q.shape[1]
    if slopes.dim() != 1 or slopes.shape[0] != H:
        raise ValueError(f"alibi_slopes must have shape (H,) = ({H},), got {tuple(slopes.shape)}")
    if slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {slopes.device} but q is on {q.device}")
    return slopes.detach().to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _check_softcap(softcap: object) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a positive finite float or None, got {softcap!r}")
    return float(softcap)
