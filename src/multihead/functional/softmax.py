"""The masked softmax every explicit attention path shares.

``masked_softmax`` turns scores into weights over the keys a query may see:

* hidden keys are excluded with ``where`` (``masked_fill``), never by adding
  -inf, so a NaN or inf score at a hidden key changes nothing;
* a query row that may see no key gets all-zero weights, and zero gradients,
  never NaN::

      allowed             weights
      q0  T T .           q0  p p 0
      q1  . . .    ->     q1  0 0 0     (nothing visible: zeros)
      q2  T . T           q2  p 0 p

* float16 and bfloat16 scores are exponentiated and summed in float32, then
  rounded once to the input dtype.

No host syncs and no data-dependent branches, so it runs inside
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch

__all__ = ["masked_softmax", "sink_softmax"]

_HALF = (torch.float16, torch.bfloat16)


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor | None, dim: int = -1) -> torch.Tensor:
    """Softmax of ``scores`` over ``dim`` restricted to the ``allowed`` entries.

    Args:
        scores: [..., T, S] floating scores (e.g. [B, H, T, S]).
        allowed: bool, True = may attend, broadcastable to ``scores``
            (e.g. [T, S] or [B, 1, T, S]); None: every key is visible (a
            plain softmax).
        dim: the key axis the weights sum over.

    Returns:
        [..., T, S] weights in the dtype of ``scores``: each row sums to 1 over
        its allowed entries, 0 at hidden entries, all zeros for a row with no
        allowed entry.

    Raises:
        TypeError: ``scores`` not a floating tensor, ``allowed`` not bool.
    """
    if not isinstance(scores, torch.Tensor) or not scores.is_floating_point():
        raise TypeError(f"scores must be a floating torch.Tensor, got {getattr(scores, 'dtype', type(scores))}")
    compute = torch.float32 if scores.dtype in _HALF else scores.dtype
    if allowed is None:
        return torch.softmax(scores, dim=dim, dtype=compute).to(scores.dtype)
    if not isinstance(allowed, torch.Tensor) or allowed.dtype != torch.bool:
        raise TypeError(
            f"allowed must be a bool torch.Tensor (True = may attend), got {getattr(allowed, 'dtype', allowed)}"
        )
    row_ok = allowed.any(dim=dim, keepdim=True)  # (..., T, 1) for dim=-1
    # masked_fill (a where), not + -inf: a NaN score at a hidden key is replaced.
    scores = scores.masked_fill(~allowed, float("-inf"))
    # Rows with nothing to attend to get finite scores, then zero weights.
    scores = scores.masked_fill(~row_ok, 0.0)
    probs = torch.softmax(scores, dim=dim, dtype=compute).masked_fill(~row_ok, 0.0)
    return probs.to(scores.dtype)


def sink_softmax(scores: torch.Tensor, allowed: torch.Tensor | None, sinks: torch.Tensor) -> torch.Tensor:
    """``masked_softmax`` over the keys plus one always-visible column per row holding
    the head's sink logit, which is then dropped (gpt-oss's learned sinks).

    Args:
        scores: [B, H, T, S]; allowed: as for ``masked_softmax`` (broadcastable
            to [B, H, T, S]) or None; sinks: [H] logits, in the scores' dtype.

    Returns:
        [B, H, T, S]: each row sums to 1 - p_sink < 1; a row with no allowed key
        is all zeros (its whole probability sits on the sink).
    """
    B, H, T, S = scores.shape
    column = sinks[None, :, None, None].expand(B, H, T, 1)  # (H,) -> (B, H, T, 1)
    scores = torch.cat([scores, column], dim=-1)  # (B, H, T, S + 1)
    if allowed is not None:
        allowed = allowed.expand(*allowed.shape[:2], T, S)  # rows may broadcast: give them T
        ones = torch.ones((*allowed.shape[:3], 1), dtype=torch.bool, device=allowed.device)
        allowed = torch.cat([allowed, ones], dim=-1)  # (B|1, H|1, T, S + 1): the sink always visible
    return masked_softmax(scores, allowed)[..., :S]
