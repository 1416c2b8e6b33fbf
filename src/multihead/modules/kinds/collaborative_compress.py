"""Converting to and compressing collaborative attention (Cordonnier et al., 2020).

``CollaborativeAttention.from_mha`` and ``.compress`` call these functions:

    from_mha: MHA (H heads of width D)  -> collaborative, D̃ = H·D, exact
    compress: collaborative (D̃ wide)   -> collaborative, D̃ = rank, via the SVD
              of every head's bilinear form A_h = W_Qᵀ diag(m_h) W_K [C, kdim]

Both return modules without rope and qk_norm, and refuse modules that use
them: the content scores re-parametrise exactly only without them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..._checks import positive_int
from .mha import MultiHeadAttention

if TYPE_CHECKING:
    from .collaborative import CollaborativeAttention

__all__ = ["Compression", "from_mha", "compress"]


def _relative(exact: torch.Tensor, approx: torch.Tensor) -> float:
    """‖exact − approx‖_F / ‖exact‖_F (0 when both are 0)."""
    num, den = float(torch.linalg.norm(exact - approx)), float(torch.linalg.norm(exact))
    return num / den if den > 0 else (0.0 if num == 0 else math.inf)


@dataclass(frozen=True)
class Compression:
    """What :meth:`CollaborativeAttention.compress` returns.

    Attributes:
        module: the compressed CollaborativeAttention (D̃ = rank).
        product_error: ‖A − Â‖_F / ‖A‖_F over the stacked per-head forms
            A_h = W_Qᵀ diag(m_h) W_K (0 when A = 0).
        output_error: ‖y − ŷ‖_F / ‖y‖_F on the given inputs (0 when y = 0),
            or None without inputs.
    """

    module: CollaborativeAttention
    product_error: float
    output_error: float | None


def from_mha(cls: type[CollaborativeAttention], mha: MultiHeadAttention, shared_dim: int | None = None) -> CollaborativeAttention:
    """Re-parametrise a trained ``MultiHeadAttention`` as collaborative heads.

    With ``shared_dim=None`` the result is exact (the paper's concatenate
    case): D̃ = H·D, W_Q and W_K copied (GQA key heads repeated to H),
    CONCATENATE mixing, ``content_bias[h] = b_Q,h · W_K,h`` and
    ``scale = 1/sqrt(D)``; the key bias b_K is dropped (it only adds a
    per-row constant, which cancels in the softmax). Values and the output
    projection are copied. With ``shared_dim=r`` the exact module is then
    compressed with :func:`compress` (see there; use it directly to get
    the error too). The result has no rope and no qk_norm.

    Raises:
        TypeError: not a MultiHeadAttention.
        ValueError: ``mha`` uses rope or qk_norm (per-head rotations and
            norms over D do not re-parametrise exactly onto D̃ channels).
    """
    if not isinstance(mha, MultiHeadAttention):
        raise TypeError(f"from_mha needs a MultiHeadAttention, got {type(mha).__name__}")
    if mha.rope is not None or mha.qk_norm is not None:
        raise ValueError("from_mha needs a MultiHeadAttention without rope and qk_norm (not exactly convertible)")
    H, G, D = mha.num_heads, mha.num_kv_heads, mha.head_dim
    w = mha.projection_weights()
    (Wq, bq), (Wk, _), (Wv, bv) = w["q"], w["k"], w["v"]
    Wo, bo = mha.out_proj.weight, mha.out_proj.bias
    ref = Wo
    mod = cls(
        mha.embed_dim,
        H,
        shared_dim=H * D,
        head_dim=D,
        kdim=mha.kdim,
        vdim=mha.vdim,
        qkv_bias=bv is not None,
        out_bias=bo is not None,
        dropout=mha.dropout,
        scale=D**-0.5,
        mixing_init="concatenate",
        device=ref.device,
        dtype=ref.dtype,
    )
    R = H // G
    with torch.no_grad():
        Wk_h = Wk.view(G, D, mha.kdim).repeat_interleave(R, dim=0)  # (G, D, kdim) -> (H, D, kdim)
        Wv_h = Wv.view(G, D, mha.vdim).repeat_interleave(R, dim=0)  # (G, D, vdim) -> (H, D, vdim)
        mod.q_proj.weight.copy_(Wq)
        mod.k_proj.weight.copy_(Wk_h.reshape(H * D, mha.kdim))
        if bq is None:
            mod.content_bias.weight.zero_()
        else:
            mod.content_bias.weight.copy_(torch.einsum("hd,hdr->hr", bq.view(H, D), Wk_h))
        mod.v_proj.weight.copy_(Wv_h.reshape(H * D, mha.vdim))
        if bv is not None:
            mod.v_proj.bias.copy_(bv.view(G, D).repeat_interleave(R, dim=0).reshape(H * D))
        mod.out_proj.weight.copy_(Wo)
        if bo is not None:
            mod.out_proj.bias.copy_(bo)
    mod.train(mha.training)
    if shared_dim is not None:
        return compress(mod, shared_dim).module
    return mod


def compress(module: CollaborativeAttention, rank: int, *, query: torch.Tensor | None = None, **forward_kwargs) -> Compression:
    """Shrink D̃ to ``rank`` by keeping the top singular directions.

    Each head's bilinear form A_h = W_Qᵀ diag(m_h) W_K [C, kdim] is
    decomposed by SVD, A_h = Σ_i σ_{h,i} u_{h,i} v_{h,i}ᵀ. The ``rank``
    largest σ over ALL heads are kept; each kept triplet becomes one
    shared channel: query row √σ·uᵀ, key row √σ·vᵀ, mixing one-hot on its
    head. The stacked error ‖A − Â‖_F² is the sum of the dropped σ², so
    it never increases with ``rank``; for a module from :func:`from_mha`
    (rank A_h ≤ D) ``rank = H·D`` is exact. Values, content bias, output
    projection and ``scale`` are kept (unlike the official
    ``swap_to_collaborative``, which rescales the logits by sqrt(D/D̃)).

    Args:
        rank: the new D̃, 1 … shared_dim.
        query: optional inputs [B, T, C]; with them the output error of
            the compressed module is measured (``forward_kwargs`` are
            passed to both calls, e.g. ``is_causal=True``).

    Returns:
        Compression(module, product_error, output_error); the module
        has no rope and no qk_norm.

    Raises:
        ValueError: rank outside 1 … shared_dim, or this module uses rope
            or qk_norm (the SVD of A_h ignores both, so it would not
            approximate the module's function).
    """
    positive_int("rank", rank)
    if module.rope is not None or module.qk_norm is not None:
        raise ValueError("compress needs a module without rope and qk_norm; they are not part of A_h")
    if rank > module.shared_dim:
        raise ValueError(f"rank must lie in 1 … shared_dim={module.shared_dim}, got rank={rank}")
    H = module.num_heads
    with torch.no_grad():
        A = module.head_products()  # (H, C, kdim)
        U, sig, Vh = torch.linalg.svd(A, full_matrices=False)  # (H, C, n), (H, n), (H, n, kdim)
        n = sig.shape[1]
        top = torch.argsort(sig.reshape(-1), descending=True, stable=True)[:rank]
        heads, idx = top // n, top % n
        root = sig[heads, idx].sqrt()  # (rank,)
        Wq = U[heads, :, idx] * root[:, None]  # (rank, C)
        Wk = Vh[heads, idx, :] * root[:, None]  # (rank, kdim)
        mixing = torch.zeros(H, rank, dtype=A.dtype, device=A.device)
        mixing[heads, torch.arange(rank, device=A.device)] = 1.0
        ref = module.out_proj.weight
        small = type(module)(
            module.embed_dim,
            H,
            shared_dim=rank,
            head_dim=module.head_dim,
            kdim=module.kdim,
            vdim=module.vdim,
            qkv_bias=module.v_proj.bias is not None,
            out_bias=module.out_proj.bias is not None,
            out_dim=module.out_dim,
            dropout=module.dropout,
            scale=module.scale,
            mixing_init="concatenate",
            device=ref.device,
            dtype=ref.dtype,
        )
        small.load_state_dict({**module.state_dict(), "q_proj.weight": Wq, "k_proj.weight": Wk, "mixing": mixing})
        small.train(module.training)
        product_error = _relative(A, small.head_products())
        output_error = None
        if query is not None:
            y, y_small = module(query, **forward_kwargs), small(query, **forward_kwargs)
            output_error = _relative(y, y_small)
    return Compression(small, product_error, output_error)
