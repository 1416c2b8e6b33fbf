"""The linear algebra of converting to and compressing collaborative attention
(Cordonnier et al., 2020), on tensors only.

``CollaborativeAttention.from_mha`` and ``.compress`` build their modules
from these functions:

    exact_weights:        MHA projections (H heads of width D) -> the weights of
                          the collaborative module with D̃ = H·D that computes
                          the same scores
    top_singular_channels: per-head bilinear forms A_h [H, C, kdim] -> the
                          ``rank`` shared channels of their largest singular values
    relative_error:       ‖exact − approx‖_F / ‖exact‖_F
"""

from __future__ import annotations

import math

import torch

from ..._checks import positive_int

__all__ = ["exact_weights", "top_singular_channels", "relative_error"]


def relative_error(exact: torch.Tensor, approx: torch.Tensor) -> float:
    """‖exact − approx‖_F / ‖exact‖_F (0 when both are 0, inf when only ``exact`` is)."""
    num, den = float(torch.linalg.norm(exact - approx)), float(torch.linalg.norm(exact))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


def exact_weights(
    q: tuple[torch.Tensor, torch.Tensor | None],
    k: torch.Tensor,
    v: tuple[torch.Tensor, torch.Tensor | None],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> dict[str, torch.Tensor]:
    """The collaborative weights (D̃ = H·D, CONCATENATE mixing) equal to an MHA's.

    W_Q is copied and W_K is copied with each key/value head repeated to its
    H // G query heads, so head h's mixing row (ones on its own D channels)
    selects exactly its own q·k. The query bias becomes the content bias,
    ``content_bias[h] = b_Q,h · W_K,h``; the key bias is not needed (it adds
    a per-row constant, which cancels in the softmax). Values are repeated
    like keys. With ``scale = 1/sqrt(D)`` the scores equal the MHA's.

    Args:
        q: (W_Q [H·D, C], b_Q [H·D] or None).
        k: W_K [G·D, kdim].
        v: (W_V [G·D, vdim], b_V [G·D] or None).
        num_heads, num_kv_heads, head_dim: H, G and D of the MHA.

    Returns:
        ``q_proj.weight`` [H·D, C], ``k_proj.weight`` [H·D, kdim],
        ``content_bias.weight`` [H, kdim], ``v_proj.weight`` [H·D, vdim] and,
        when b_V is given, ``v_proj.bias`` [H·D] (new tensors).
    """
    H, G, D = num_heads, num_kv_heads, head_dim
    (Wq, bq), (Wv, bv) = q, v
    R = H // G
    kdim, vdim = k.shape[1], Wv.shape[1]
    Wk_h = k.reshape(G, D, kdim).repeat_interleave(R, dim=0)  # (G·D, kdim) -> (H, D, kdim)
    Wv_h = Wv.reshape(G, D, vdim).repeat_interleave(R, dim=0)  # (G·D, vdim) -> (H, D, vdim)
    if bq is None:
        content_bias = k.new_zeros(H, kdim)
    else:
        content_bias = torch.einsum("hd,hdr->hr", bq.reshape(H, D), Wk_h)  # (H, kdim)
    out = {
        "q_proj.weight": Wq.clone(),
        "k_proj.weight": Wk_h.reshape(H * D, kdim),
        "content_bias.weight": content_bias,
        "v_proj.weight": Wv_h.reshape(H * D, vdim),
    }
    if bv is not None:
        out["v_proj.bias"] = bv.reshape(G, D).repeat_interleave(R, dim=0).reshape(H * D)
    return out


def top_singular_channels(A: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``rank`` shared channels that best approximate the per-head forms.

    Each A_h [C, kdim] is decomposed by SVD, A_h = Σ_i σ_{h,i} u_{h,i} v_{h,i}ᵀ.
    The ``rank`` largest σ over ALL heads are kept (ties in head order); each
    kept triplet becomes one shared channel: query row √σ·uᵀ, key row √σ·vᵀ,
    mixing one-hot on its head. The stacked error ‖A − Â‖_F² is the sum of
    the dropped σ², so it never increases with ``rank``.

    Args:
        A: [H, C, kdim], the forms A_h = W_Qᵀ diag(m_h) W_K.
        rank: channels to keep, 1 … H·min(C, kdim).

    Returns:
        (W_Q [rank, C], W_K [rank, kdim], mixing [H, rank]).

    Raises:
        TypeError, ValueError: ``rank`` is not a positive int, or more than
            the forms have singular values.
    """
    positive_int("rank", rank)
    H = A.shape[0]
    U, sig, Vh = torch.linalg.svd(A, full_matrices=False)  # (H, C, n), (H, n), (H, n, kdim)
    n = sig.shape[1]
    if rank > H * n:
        raise ValueError(f"rank must be at most H·min(C, kdim) = {H * n}, got rank={rank}")
    top = torch.argsort(sig.reshape(-1), descending=True, stable=True)[:rank]
    heads, idx = top // n, top % n
    root = sig[heads, idx].sqrt()  # (rank,)
    Wq = U[heads, :, idx] * root[:, None]  # (rank, C)
    Wk = Vh[heads, idx, :] * root[:, None]  # (rank, kdim)
    mixing = torch.zeros(H, rank, dtype=A.dtype, device=A.device)
    mixing[heads, torch.arange(rank, device=A.device)] = 1.0
    return Wq, Wk, mixing
