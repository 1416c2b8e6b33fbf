"""Converting to and compressing collaborative attention (Cordonnier et al., 2020).

``CollaborativeAttention.from_mha`` and ``.compress`` are written here, as
functions of the class or module they build from, on top of the linear
algebra on tensors:

    collaborative_from_mha(cls, mha, shared_dim)  a MultiHeadAttention -> collaborative heads
    compress_collaborative(layer, rank, query)     fewer shared channels -> ``Compression``
    exact_weights:        MHA projections (H heads of width D) -> the weights of
                          the collaborative module with D̃ = H·D that computes
                          the same scores
    top_singular_channels: per-head bilinear forms A_h [H, C, kdim] -> the
                          ``rank`` shared channels of their largest singular values
    relative_error:       ‖exact − approx‖_F / ‖exact‖_F
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..._checks import positive_int
from .mha import MultiHeadAttention

__all__ = [
    "Compression", "collaborative_from_mha", "compress_collaborative", "exact_weights", "top_singular_channels",
    "relative_error",
]  # fmt: skip


@dataclass(frozen=True)
class Compression:
    """What ``CollaborativeAttention.compress`` returns.

    Attributes:
        module: the compressed CollaborativeAttention (D̃ = rank).
        product_error: ‖A − Â‖_F / ‖A‖_F over the stacked per-head forms
            A_h = W_Qᵀ diag(m_h) W_K (0 when A = 0).
        output_error: ‖y − ŷ‖_F / ‖y‖_F on the given inputs (0 when y = 0),
            or None without inputs.
    """

    module: nn.Module
    product_error: float
    output_error: float | None


def collaborative_from_mha(cls: type, mha: MultiHeadAttention, shared_dim: int | None) -> nn.Module:
    """``cls.from_mha(mha, shared_dim)`` (``cls``: ``CollaborativeAttention`` or a
    subclass); its docstring says what the result is.

    Raises:
        TypeError: ``mha`` is not a MultiHeadAttention.
        ValueError: ``mha`` uses rope or qk_norm.
    """
    if not isinstance(mha, MultiHeadAttention):
        raise TypeError(f"from_mha needs a MultiHeadAttention, got {type(mha).__name__}")
    if mha.rope is not None or mha.qk_norm is not None:
        raise ValueError("from_mha needs a MultiHeadAttention without rope and qk_norm (not exactly convertible)")
    H, D = mha.num_heads, mha.head_dim
    w = mha.projection_weights()
    Wo, bo = mha.out_proj.weight, mha.out_proj.bias
    mod = cls(
        mha.embed_dim, H, shared_dim=H * D, head_dim=D, kdim=mha.kdim, vdim=mha.vdim,
        qkv_bias=w["v"][1] is not None, out_bias=bo is not None, dropout=mha.dropout, scale=D**-0.5,
        mixing_init="concatenate", device=Wo.device, dtype=Wo.dtype,
    )  # fmt: skip
    with torch.no_grad():
        state = exact_weights(w["q"], w["k"][0], w["v"], num_heads=H, num_kv_heads=mha.num_kv_heads, head_dim=D)
        state["out_proj.weight"] = Wo
        if bo is not None:
            state["out_proj.bias"] = bo
        mod.load_state_dict(state, strict=False)  # the mixing stays the CONCATENATE one
    mod.train(mha.training)
    return mod if shared_dim is None else mod.compress(shared_dim).module


def compress_collaborative(
    layer: nn.Module, rank: int, *, query: torch.Tensor | None = None, **forward_kwargs
) -> Compression:
    """``layer.compress(rank, query=query, **forward_kwargs)`` for a
    ``CollaborativeAttention`` ``layer``; its docstring says what is kept.

    Raises:
        ValueError: rank outside 1 … shared_dim, or ``layer`` uses rope or qk_norm.
    """
    positive_int("rank", rank)
    if layer.rope is not None or layer.qk_norm is not None:
        raise ValueError("compress needs a module without rope and qk_norm; they are not part of A_h")
    if rank > layer.shared_dim:
        raise ValueError(f"rank must lie in 1 … shared_dim={layer.shared_dim}, got rank={rank}")
    ref = layer.out_proj.weight
    options = {**layer.init_options, "shared_dim": rank, "rope": False, "qk_norm": False}
    with torch.no_grad():
        A = layer.head_products()  # (H, C, kdim)
        Wq, Wk, mixing = top_singular_channels(A, rank)
        small = type(layer)(layer.embed_dim, layer.num_heads, head_dim=layer.head_dim, mixing_init="concatenate",
                            device=ref.device, dtype=ref.dtype, **options)  # fmt: skip
        small.load_state_dict({**layer.state_dict(), "q_proj.weight": Wq, "k_proj.weight": Wk, "mixing": mixing})
        small.train(layer.training)
        product_error = relative_error(A, small.head_products())
        output_error = None
        if query is not None:
            output_error = relative_error(layer(query, **forward_kwargs), small(query, **forward_kwargs))
    return Compression(small, product_error, output_error)


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
