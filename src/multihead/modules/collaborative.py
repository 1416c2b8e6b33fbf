"""Collaborative multi-head attention (Cordonnier, Loukas, Jaggi, 2020).

All heads share one query and one key projection of width D̃ (``shared_dim``);
head h scores with its own mixing vector m_h and a per-head key-content bias::

    x (B, T, C) --q_proj--> Q (B, T, D̃)          shared by every head
    x_to (B, S, Ck) --k_proj--> K (B, S, D̃), --content_bias--> cb (B, S, H)
    score_h = scale * ((Q ⊙ m_h) Kᵀ + cb[..., h])   -> softmax -> P_h
    out = out_proj(concat_h P_h V_h)                 values as in MHA

Fast path: the per-head bias rides along in H extra channels, so every head
is one dot product against ONE shared key head::

    q_h = [Q ⊙ m_h | e_h]        (B, H, T, D̃ + H)   e_h one-hot on head h
    k   = [K       | cb ]        (B, 1, S, D̃ + H)   one key head for all H
    q_h · k_j = (Q ⊙ m_h)·K_j + cb[j, h]

``functional.attention`` then runs the fused ``sdpa`` kernel (the key head
is passed as a stride-0 expanded view, never materialised, because the
values keep H heads). The KV cache stores that one augmented key head plus
the H value heads. ``from_mha`` re-parametrises a trained MHA exactly;
``compress`` shrinks D̃ by keeping the top singular directions of the
per-head bilinear forms (see ``multihead.modules.collaborative_compress``).

Rope and QK-norm (options ``rope=`` / ``qk_norm=``, both off by default)::

    Q, K --qk_norm over D̃ (gains [D̃])--> Q, K      on the SHARED query/key
    q_h = Q ⊙ m_h                                    per-head mixing
    q_h, K --rope over D̃ (rotary_dim <= D̃, even)--> rotated at their positions
    q_h = [rope(q_h) | e_h],  k = [rope(K) | cb]     bias channels never touched

QK-norm normalises the shared Q and K before the mixing (one RMS over the D̃
channels, learned gains ``qk_norm.{q,k}_norm.weight`` [D̃]). Rope rotates
AFTER the mixing, i.e. the per-head query Q ⊙ m_h and the shared key K:
then score_h[i, j] = (Q_i ⊙ m_h)ᵀ R(p_j − p_i) K_j depends on the positions
only through their difference. Rotating Q before the mixing would not:
diag(m_h) does not commute with the 2×2 rotations unless m_h is equal on
both channels of every rotated pair. The H content-bias channels carry no
position and are never normalised or rotated. The cache stores the rotated
key head. ``from_mha`` and ``compress`` re-parametrise the content scores
exactly only without rope/qk_norm (both change the function), so they refuse
modules that use them and always return modules without rope/qk_norm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .._checks import dropout_probability, positive_int
from ..functional import attention, merge_masks
from ..functional.rope import apply_rope
from .attention import MultiHeadAttention, check_heads
from .calls import check_call, default_alignment, rollback_on_error
from .cost import AttentionCost, visible_pairs
from .kv_cache import KVCache
from .observe import AttentionEvent, Observable
from .registry import register_attention
from .rotary_qk import RotaryQK

__all__ = ["CollaborativeAttention", "Compression", "concatenate_mixing"]

_MIXING_INITS = ("normal", "concatenate")


def concatenate_mixing(num_heads: int, shared_dim: int, **factory) -> torch.Tensor:
    """The CONCATENATE mixing matrix [H, D̃]: row h is 1 on channels
    h·⌈D̃/H⌉ … (h+1)·⌈D̃/H⌉ − 1 (the last heads get fewer, maybe none)."""
    width = -(-shared_dim // num_heads)  # ceil
    m = torch.zeros(num_heads, shared_dim, **factory)
    for h in range(num_heads):
        m[h, h * width : (h + 1) * width] = 1.0
    return m


class CollaborativeAttention(RotaryQK, Observable, nn.Module):
    """Multi-head attention whose heads share their query/key projections.

    Args:
        embed_dim: C, width of queries (and of outputs unless ``out_dim``).
        num_heads: H.
        shared_dim: D̃, the shared key/query width (default C).
        head_dim: Dv, value width per head (default C // H).
        kdim, vdim: widths of key and value inputs (default C).
        qkv_bias: bias of the value projection (queries and keys have none;
            the content bias plays the query bias's role).
        out_bias: bias of ``out_proj``.
        out_dim: output width (default C).
        dropout: dropout on the attention weights in training mode.
        scale: score multiplier (default 1 / sqrt(D̃ / H), the official choice).
        mixing_init: "normal" (N(0, 0.2²), the official "UNIFORM") or
            "concatenate" (block one-hot rows).
        rope: rotary position embeddings over the D̃ shared channels of the
            mixed queries Q ⊙ m_h and of the shared keys K (never the
            content-bias channels): False, True (base 10000, rotate-half,
            all D̃ channels; needs an even D̃) or a dict of ``apply_rope``
            options ``base``, ``interleaved``, ``rotary_dim`` (even, <= D̃).
            Positions are 0 .. T-1, offset by the cache length when decoding,
            or the ``positions`` argument of ``forward``.
        qk_norm: RMS-normalise the shared Q and K over D̃ before the mixing,
            with learned gains ``qk_norm.q_norm.weight`` / ``qk_norm.k_norm.weight`` [D̃].
        device, dtype: of the parameters.

    Order inside forward: Q, K projections -> qk_norm -> mixing Q ⊙ m_h ->
    rope -> append the content-bias channels -> attention.

    Parameters: ``q_proj`` [D̃, C], ``k_proj`` [D̃, kdim], ``mixing`` [H, D̃],
    ``content_bias`` [H, kdim] (all bias-free), ``v_proj`` [H·Dv, vdim],
    ``out_proj`` [out_dim, H·Dv]; with ``qk_norm`` also
    ``qk_norm.q_norm.weight`` and ``qk_norm.k_norm.weight`` [D̃].

    Raises:
        ValueError: invalid sizes, dropout, scale, mixing_init or rope options
            (e.g. an odd D̃ without an even ``rotary_dim``).
    """

    kind = "collaborative"

    def aux_loss(self) -> torch.Tensor:
        """The training loss term of the last forward: a 0-d zero (this kind has
        none), on the device and dtype of ``out_proj.weight``."""
        w = self.out_proj.weight
        return torch.zeros((), device=w.device, dtype=w.dtype)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        shared_dim: int | None = None,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        qkv_bias: bool = True,
        out_bias: bool = True,
        out_dim: int | None = None,
        dropout: float = 0.0,
        scale: float | None = None,
        mixing_init: str = "normal",
        rope: bool | dict = False,
        qk_norm: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        H, _, Dv = check_heads(embed_dim, num_heads, None, head_dim)
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, H, Dv
        self.shared_dim = embed_dim if shared_dim is None else positive_int("shared_dim", shared_dim)
        self.kdim = embed_dim if kdim is None else positive_int("kdim", kdim)
        self.vdim = embed_dim if vdim is None else positive_int("vdim", vdim)
        self.out_dim = embed_dim if out_dim is None else positive_int("out_dim", out_dim)
        self.dropout = dropout_probability(dropout)
        if scale is None:
            scale = 1.0 / math.sqrt(self.shared_dim / H)
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a positive finite float, got scale={scale!r}")
        self.scale = float(scale)
        if mixing_init not in _MIXING_INITS:
            raise ValueError(f"mixing_init must be one of {_MIXING_INITS}, got mixing_init={mixing_init!r}")
        factory = {"device": device, "dtype": dtype}
        Dt = self.shared_dim
        self.q_proj = nn.Linear(embed_dim, Dt, bias=False, **factory)
        self.k_proj = nn.Linear(self.kdim, Dt, bias=False, **factory)
        self.content_bias = nn.Linear(self.kdim, H, bias=False, **factory)
        self.mixing = nn.Parameter(torch.empty(H, Dt, **factory))
        self.v_proj = nn.Linear(self.vdim, H * Dv, bias=qkv_bias, **factory)
        self.out_proj = nn.Linear(H * Dv, self.out_dim, bias=out_bias, **factory)
        with torch.no_grad():
            if mixing_init == "normal":
                self.mixing.normal_(0.0, 0.2)
            else:
                self.mixing.copy_(concatenate_mixing(H, Dt))
        try:
            self.init_rotary_qk(rope, qk_norm, Dt, **factory)
        except ValueError as err:
            raise ValueError(f"{err} [collaborative rope rotates the shared_dim={Dt} query/key channels]") from None

    # ------------------------------------------------------------------ projections
    def project(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project to the augmented per-head queries, the one key head and values.

        With ``qk_norm`` the shared Q and K are RMS-normalised over D̃ before
        the mixing; with ``rope`` the mixed queries Q ⊙ m_h and the keys K
        are rotated at ``positions`` / ``key_positions`` ([T] / [S] or
        [B, T] / [B, S]; default 0 .. T-1 / 0 .. S-1). The content-bias
        channels are never normalised or rotated.

        Args:
            query: [B, T, C]; key: [B, S, kdim] or None (self-attention);
            value: [B, S, vdim] or None (the key tensor).
            positions, key_positions: rope positions (only used with rope).

        Returns:
            q [B, H, T, D̃+H] = [Q ⊙ m_h | e_h], k [B, 1, S, D̃+H] = [K | cb],
            v [B, H, S, Dv]; scale · q_h · k_j is score_h[i, j].
        """
        H, Dv = self.num_heads, self.head_dim
        key = query if key is None else key
        value = key if value is None else value
        B, T, _ = query.shape
        S = key.shape[1]
        Q = self.q_proj(query).unsqueeze(1)  # (B, T, D̃) -> (B, 1, T, D̃)
        K = self.k_proj(key).unsqueeze(1)  # (B, S, D̃) -> (B, 1, S, D̃)
        if self.qk_norm is not None:
            Q, K = self.qk_norm(Q, K)  # RMS over D̃ of the shared query / key
        q = Q * self.mixing[None, :, None, :]  # (B, 1, T, D̃) -> (B, H, T, D̃)
        if self.rope is not None:
            q = apply_rope(q, positions, **self.rope)  # rotate Q ⊙ m_h, after the mixing
            K = apply_rope(K, key_positions, **self.rope)
        onehot = torch.eye(H, dtype=q.dtype, device=q.device)[None, :, None, :]  # (1, H, 1, H)
        q = torch.cat([q, onehot.expand(B, H, T, H)], dim=-1)  # (B, H, T, D̃ + H)
        cb = self.content_bias(key).unsqueeze(1)  # (B, S, H) -> (B, 1, S, H)
        k = torch.cat([K, cb], dim=-1)  # (B, 1, S, D̃ + H)
        v = self.v_proj(value).view(B, S, H, Dv).transpose(1, 2)  # (B, S, H*Dv) -> (B, H, S, Dv)
        return q, k, v

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H, T, Dv] head outputs -> [B, T, out_dim] through ``out_proj``."""
        B, H, T, Dv = out.shape
        out = out.transpose(1, 2).reshape(B, T, H * Dv)  # (B, H, T, Dv) -> (B, T, H*Dv)
        return self.out_proj(out)

    def make_kv_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None) -> KVCache:
        """A cache holding ONE augmented key head [B, 1, max_len, D̃+H] and the
        values flattened to [B, 1, max_len, H·Dv]."""
        ref = self.out_proj.weight
        return KVCache(
            batch_size,
            1,
            max_len,
            self.shared_dim + self.num_heads,
            value_dim=self.num_heads * self.head_dim,
            dtype=dtype or ref.dtype,
            device=device or ref.device,
        )

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        attn_mask: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        causal_alignment: str | None = None,
        return_weights: bool = False,
        kv_cache: KVCache | None = None,
        backend: str = "auto",
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when None).

        Args: as :meth:`MultiHeadAttention.forward`: attn_mask bool (True =
        may attend) or float (added to the scaled scores), (T, S) or 4-D;
        key_padding_mask [B, S] (True = real key, or float added);
        causal_alignment defaults to "bottom_right" with a cache;
        kv_cache from :meth:`make_kv_cache` (self-attention only);
        positions: rope positions of the T queries, [T] or [B, T] (also of
        the new keys in self-attention); default 0 .. T-1 offset by the
        cache length before this call's write; cross-attention keys sit at
        0 .. S-1; only valid with ``rope``. The cache stores rotated keys.

        Returns:
            out [B, T, out_dim], or (out, weights [B, H, T, S]): the
            post-softmax probabilities P_h that mix the values (before dropout).
            Observers receive the same weights, with ``q`` = [B, H, T, D̃+H]
            augmented queries, ``k`` = [B, 1, S, D̃+H] = [K | cb] (after
            qk_norm and rope) and ``scale``, so scale · q·k reproduces the
            scores before masking.

        Raises:
            ValueError / TypeError: shapes, widths, masks, cache overflow
                (before anything is written).
        """
        check_call(query, key, value, kv_cache, embed_dim=self.embed_dim, kdim=self.kdim, vdim=self.vdim)
        B = query.shape[0]
        q_pos = k_pos = None
        if self.rope is not None or positions is not None:
            q_pos, k_pos = self.call_positions(positions, query, key, kv_cache)  # cross-attention keys at 0 .. S-1
        q, k, v = self.project(query, key, value, positions=q_pos, key_positions=k_pos)
        H, Dv = self.num_heads, self.head_dim
        causal_alignment = default_alignment(causal_alignment, kv_cache)
        observed = self.observed
        with rollback_on_error(kv_cache):
            if kv_cache is not None:
                T_new = v.shape[2]
                flat = v.transpose(1, 2).reshape(B, 1, T_new, H * Dv)  # (B, H, T, Dv) -> (B, 1, T, H*Dv)
                k, flat = kv_cache.update(k, flat)
                v = flat[:, 0].unflatten(-1, (H, Dv)).transpose(1, 2)  # (B, L, H*Dv) -> (B, H, L, Dv)
            S = k.shape[2]
            mask = merge_masks(attn_mask, MultiHeadAttention._padding(key_padding_mask, B, S))
            out = attention(
                q,
                k.expand(B, H, S, k.shape[-1]),  # one key head, stride 0 over heads
                v,
                attn_mask=mask,
                is_causal=is_causal,
                causal_alignment=causal_alignment,
                scale=self.scale,
                dropout_p=self.dropout,
                training=self.training,
                return_weights=return_weights or observed,
                backend=backend,
            )
        weights = None
        if return_weights or observed:
            out, weights = out
        if observed:
            self._notify(
                AttentionEvent(
                    weights=weights.detach(),
                    q=q.detach(),
                    k=k.detach(),
                    scale=self.scale,
                    attn_mask=mask,
                    is_causal=is_causal,
                    causal_alignment=causal_alignment,
                    kind=self.kind,
                )
            )
        out = self.merge_heads(out)
        return (out, weights) if return_weights else out

    # ------------------------------------------------------------------ accounting
    def cost(
        self,
        T: int,
        S: int | None = None,
        *,
        batch: int = 1,
        causal: bool = False,
        bytes_per_element: int = 2,
    ) -> AttentionCost:
        """FLOPs, parameters and cache bytes of one call (``modules.cost`` conventions).

        With P visible (query, key) pairs, D̃ = shared_dim, Dv = head_dim:

        core = 2·B·H·P·(D̃ + H + Dv)   scores over the D̃ shared channels plus
               the H content-bias channels, and the value mixing
             + B·H·T·D̃                 the mixing Q ⊙ m_h (one multiply each);
        projections = 2·B·(T·C·D̃ + S·kdim·D̃ + S·kdim·H + S·vdim·H·Dv + T·H·Dv·out_dim)
               (query, key, content bias, value, output).
        Cache: (D̃ + H + H·Dv) elements per token (one augmented key head, H value heads).
        rope and qk_norm are elementwise and not counted; the qk_norm gains
        (2·D̃) are among the parameters.
        """
        S = T if S is None else S
        H, Dv, Dt = self.num_heads, self.head_dim, self.shared_dim
        pairs = visible_pairs(T, S, causal=causal)
        core = 2 * batch * H * pairs * (Dt + H + Dv) + batch * H * T * Dt
        proj = (
            2
            * batch
            * (
                T * self.embed_dim * Dt
                + S * self.kdim * Dt
                + S * self.kdim * H
                + S * self.vdim * H * Dv
                + T * H * Dv * self.out_dim
            )
        )
        params = sum(p.numel() for p in self.parameters())
        return AttentionCost(core, proj, params, (Dt + H + H * Dv) * bytes_per_element)

    # ------------------------------------------------------------------ conversion
    def head_products(self) -> torch.Tensor:
        """The per-head bilinear forms [H, C, kdim]: A_h = W_Qᵀ diag(m_h) W_K,
        so that score_h[i, j] = scale · (x_i A_h x_jᵀ + cb[j, h])."""
        Wq, Wk = self.q_proj.weight, self.k_proj.weight  # (D̃, C), (D̃, kdim)
        return torch.einsum("cp,hc,cr->hpr", Wq, self.mixing, Wk)

    @classmethod
    def from_mha(cls, mha: MultiHeadAttention, shared_dim: int | None = None) -> CollaborativeAttention:
        """Re-parametrise a trained ``MultiHeadAttention`` as collaborative heads.

        With ``shared_dim=None`` the result is exact (the paper's concatenate
        case): D̃ = H·D, W_Q and W_K copied (GQA key heads repeated to H),
        CONCATENATE mixing, ``content_bias[h] = b_Q,h · W_K,h`` and
        ``scale = 1/sqrt(D)``; the key bias b_K is dropped (it only adds a
        per-row constant, which cancels in the softmax). Values and the output
        projection are copied. With ``shared_dim=r`` the exact module is then
        compressed with :meth:`compress` (see there; use it directly to get
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
            return mod.compress(shared_dim).module
        return mod

    def compress(self, rank: int, *, query: torch.Tensor | None = None, **forward_kwargs) -> Compression:
        """Shrink D̃ to ``rank`` by keeping the top singular directions.

        Each head's bilinear form A_h = W_Qᵀ diag(m_h) W_K [C, kdim] is
        decomposed by SVD, A_h = Σ_i σ_{h,i} u_{h,i} v_{h,i}ᵀ. The ``rank``
        largest σ over ALL heads are kept; each kept triplet becomes one
        shared channel: query row √σ·uᵀ, key row √σ·vᵀ, mixing one-hot on its
        head. The stacked error ‖A − Â‖_F² is the sum of the dropped σ², so
        it never increases with ``rank``; for a module from :meth:`from_mha`
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
        if self.rope is not None or self.qk_norm is not None:
            raise ValueError("compress needs a module without rope and qk_norm; they are not part of A_h")
        if rank > self.shared_dim:
            raise ValueError(f"rank must lie in 1 … shared_dim={self.shared_dim}, got rank={rank}")
        H = self.num_heads
        with torch.no_grad():
            A = self.head_products()  # (H, C, kdim)
            U, sig, Vh = torch.linalg.svd(A, full_matrices=False)  # (H, C, n), (H, n), (H, n, kdim)
            n = sig.shape[1]
            top = torch.argsort(sig.reshape(-1), descending=True, stable=True)[:rank]
            heads, idx = top // n, top % n
            root = sig[heads, idx].sqrt()  # (rank,)
            Wq = U[heads, :, idx] * root[:, None]  # (rank, C)
            Wk = Vh[heads, idx, :] * root[:, None]  # (rank, kdim)
            mixing = torch.zeros(H, rank, dtype=A.dtype, device=A.device)
            mixing[heads, torch.arange(rank, device=A.device)] = 1.0
            ref = self.out_proj.weight
            small = type(self)(
                self.embed_dim,
                H,
                shared_dim=rank,
                head_dim=self.head_dim,
                kdim=self.kdim,
                vdim=self.vdim,
                qkv_bias=self.v_proj.bias is not None,
                out_bias=self.out_proj.bias is not None,
                out_dim=self.out_dim,
                dropout=self.dropout,
                scale=self.scale,
                mixing_init="concatenate",
                device=ref.device,
                dtype=ref.dtype,
            )
            small.load_state_dict({**self.state_dict(), "q_proj.weight": Wq, "k_proj.weight": Wk, "mixing": mixing})
            small.train(self.training)
            product_error = _relative(A, small.head_products())
            output_error = None
            if query is not None:
                y, y_small = self(query, **forward_kwargs), small(query, **forward_kwargs)
                output_error = _relative(y, y_small)
        return Compression(small, product_error, output_error)

    def extra_repr(self) -> str:
        parts = [
            f"embed_dim={self.embed_dim}",
            f"num_heads={self.num_heads}",
            f"shared_dim={self.shared_dim}",
            f"head_dim={self.head_dim}",
        ]
        if (self.kdim, self.vdim) != (self.embed_dim, self.embed_dim):
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.out_dim != self.embed_dim:
            parts.append(f"out_dim={self.out_dim}")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.rope is not None:
            parts.append(f"rope={self.rope}")
        return ", ".join(parts)


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


@register_attention("collaborative")
def _collaborative(
    *, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, **options
) -> CollaborativeAttention:
    if num_kv_heads is not None:
        raise ValueError(
            f"'collaborative' shares one key projection across heads; num_kv_heads={num_kv_heads} is not an option"
        )
    return CollaborativeAttention(embed_dim, num_heads, **options)
