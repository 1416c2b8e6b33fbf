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
per-head bilinear forms (both, and their linear algebra, are written in
``multihead.modules.kinds.collaborative_compress``).

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

import torch
from torch import nn

from ..._checks import positive_int
from ..base import AttentionLayer
from ..cost import AttentionCost, visible_pairs
from ..head_selection import head_rows, load_selected
from ..kv_cache import KVCache
from ..registry import register_attention
from .collaborative_compress import Compression, collaborative_from_mha, compress_collaborative
from .mha import MultiHeadAttention

__all__ = ["CollaborativeAttention", "concatenate_mixing"]

_MIXING_INITS = ("normal", "concatenate")


def concatenate_mixing(num_heads: int, shared_dim: int, **factory) -> torch.Tensor:
    """The CONCATENATE mixing matrix [H, D̃]: row h is 1 on channels
    h·⌈D̃/H⌉ … (h+1)·⌈D̃/H⌉ − 1 (the last heads get fewer, maybe none)."""
    width = -(-shared_dim // num_heads)  # ceil
    m = torch.zeros(num_heads, shared_dim, **factory)
    for h in range(num_heads):
        m[h, h * width : (h + 1) * width] = 1.0
    return m


class CollaborativeAttention(AttentionLayer):
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
    rope -> append the content-bias channels -> attention. The forward is
    ``AttentionLayer.forward`` (arguments, masks and cache as
    :class:`MultiHeadAttention`; the output is [B, T, out_dim]).
    ``return_weights`` gives the post-softmax probabilities P_h [B, H, T, S]
    that mix the values (before dropout); observers receive them with ``q``
    = [B, H, T, D̃+H] augmented queries, ``k`` = [B, 1, S, D̃+H] = [K | cb]
    (after qk_norm and rope) and ``scale``, so scale · q·k reproduces the
    scores before masking. The cache stores the rotated key head.

    Parameters: ``q_proj`` [D̃, C], ``k_proj`` [D̃, kdim], ``mixing`` [H, D̃],
    ``content_bias`` [H, kdim] (all bias-free), ``v_proj`` [H·Dv, vdim],
    ``out_proj`` [out_dim, H·Dv]; with ``qk_norm`` also
    ``qk_norm.q_norm.weight`` and ``qk_norm.k_norm.weight`` [D̃].

    Raises:
        ValueError: invalid sizes, dropout, scale, mixing_init or rope options
            (e.g. an odd D̃ without an even ``rotary_dim``).
    """

    kind = "collaborative"
    refused_options = ("num_kv_heads", "sinks")  # one key head serves every head
    option_refusals = {"sinks": "its core is its own, not functional.attention's softmax with a sink column"}
    independent_heads = True
    selects_weights = True  # its core is functional.attention over a stride-0 view of the key head
    head_independence = (
        "heads share the query/key projections but each scores with its own mixing row and content-bias row, "
        "reads its own value rows and reaches the output only through its own columns of out_proj"
    )

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        shared_dim: int | None = None,
        out_dim: int | None = None,
        scale: float | None = None,
        mixing_init: str = "normal",
        **options,
    ) -> None:
        super().__init__(embed_dim, num_heads, **options)
        H, Dv = self.num_heads, self.head_dim
        self.shared_dim = embed_dim if shared_dim is None else positive_int("shared_dim", shared_dim)
        self.out_dim = embed_dim if out_dim is None else positive_int("out_dim", out_dim)
        if scale is None:
            scale = 1.0 / math.sqrt(self.shared_dim / H)
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a positive finite float, got scale={scale!r}")
        self.scale = float(scale)
        if mixing_init not in _MIXING_INITS:
            raise ValueError(f"mixing_init must be one of {_MIXING_INITS}, got mixing_init={mixing_init!r}")
        factory = self.factory
        Dt = self.shared_dim
        self.init_options.update(shared_dim=Dt, out_dim=self.out_dim, scale=self.scale)
        self.q_proj = nn.Linear(embed_dim, Dt, bias=False, **factory)
        self.k_proj = nn.Linear(self.kdim, Dt, bias=False, **factory)
        self.content_bias = nn.Linear(self.kdim, H, bias=False, **factory)
        self.mixing = nn.Parameter(torch.empty(H, Dt, **factory))
        self.v_proj = nn.Linear(self.vdim, H * Dv, bias=self.qkv_bias, **factory)
        self.init_output(H * Dv, self.out_dim)
        with torch.no_grad():
            if mixing_init == "normal":
                self.mixing.normal_(0.0, 0.2)
            else:
                self.mixing.copy_(concatenate_mixing(H, Dt))
        try:
            self.init_positions(Dt)
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

        ``to_heads`` followed by ``position_qk``: with ``qk_norm`` the shared
        Q and K are RMS-normalised over D̃ before the mixing; with ``rope``
        the mixed queries Q ⊙ m_h and the keys K are rotated at
        ``positions`` / ``key_positions`` ([T] / [S] or [B, T] / [B, S];
        default 0 .. T-1 / 0 .. S-1). The content-bias channels are never
        normalised or rotated.

        Args:
            query: [B, T, C]; key: [B, S, kdim] or None (self-attention);
            value: [B, S, vdim] or None (the key tensor).
            positions, key_positions: rope positions (only used with rope).

        Returns:
            q [B, H, T, D̃+H] = [Q ⊙ m_h | e_h], k [B, 1, S, D̃+H] = [K | cb],
            v [B, H, S, Dv]; scale · q_h · k_j is score_h[i, j].
        """
        q, k, v, _ = self.to_heads(query, key, value)
        q, k = self.position_qk(q, k, positions, key_positions)
        return q, k, v

    def to_heads(self, query, key=None, value=None):
        """The shared query Q [B, 1, T, D̃], the key head [K | cb] [B, 1, S, D̃+H]
        and the values [B, H, S, Dv], before qk_norm, mixing and rope."""
        H, Dv = self.num_heads, self.head_dim
        key = query if key is None else key
        value = key if value is None else value
        B, S = query.shape[0], key.shape[1]
        Q = self.q_proj(query).unsqueeze(1)  # (B, T, D̃) -> (B, 1, T, D̃)
        K = self.k_proj(key).unsqueeze(1)  # (B, S, D̃) -> (B, 1, S, D̃)
        cb = self.content_bias(key).unsqueeze(1)  # (B, S, H) -> (B, 1, S, H)
        v = self.v_proj(value).view(B, S, H, Dv).transpose(1, 2)  # (B, S, H*Dv) -> (B, H, S, Dv)
        return Q, torch.cat([K, cb], dim=-1), v, None

    def position_qk(self, q, k, q_pos, k_pos):
        """Shared Q [B, 1, T, D̃] and [K | cb] -> qk_norm over D̃ -> mixing
        Q ⊙ m_h -> rope -> q [B, H, T, D̃+H] = [Q ⊙ m_h | e_h], k [B, 1, S, D̃+H]."""
        B, _, T, Dt = q.shape
        H = self.num_heads
        if self.qk_norm is not None or self.rope is not None:
            K, cb = k.split([Dt, H], dim=-1)
            if self.qk_norm is not None:
                q, K = self.qk_norm(q, K)  # RMS over D̃ of the shared query / key
            q = q * self.mixing[None, :, None, :]  # (B, 1, T, D̃) -> (B, H, T, D̃)
            if self.rope is not None:
                q, K = self.rope(q, q_pos), self.rope(K, k_pos)  # rotate Q ⊙ m_h, after the mixing
            k = torch.cat([K, cb], dim=-1)
        else:
            q = q * self.mixing[None, :, None, :]  # (B, 1, T, D̃) -> (B, H, T, D̃)
        onehot = torch.eye(H, dtype=q.dtype, device=q.device)[None, :, None, :]  # (1, H, 1, H)
        return torch.cat([q, onehot.expand(B, H, T, H)], dim=-1), k  # (B, H, T, D̃ + H)

    def make_kv_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None) -> KVCache:
        """A cache holding ONE augmented key head [B, 1, max_len, D̃+H] and the
        H value heads [B, H, max_len, Dv]."""
        ref = self.out_proj.weight
        return KVCache(
            batch_size, 1, max_len, self.shared_dim + self.num_heads, value_dim=self.head_dim,
            value_heads=self.num_heads, dtype=dtype or ref.dtype, device=device or ref.device,
        )  # fmt: skip

    def core(self, q, k, v, extra, **call):
        """``functional.attention`` with the one key head as a stride-0 view over the H heads."""
        B, H, _, _ = q.shape
        return super().core(q, k.expand(B, H, k.shape[2], k.shape[-1]), v, extra, **call)

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
        pairs = visible_pairs(T, S, causal=causal, window=self.sliding_window)
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

    # ------------------------------------------------------------------ heads
    def subset_heads(self, heads: list[int], kv_heads: list[int]) -> CollaborativeAttention:
        """The kept heads' rows of ``mixing``, ``content_bias`` and ``v_proj``, their
        columns of ``out_proj``; the shared projections and the score scale stay."""
        device = self.out_proj.weight.device
        idx, v_rows = torch.tensor(heads, dtype=torch.long, device=device), head_rows(heads, self.head_dim, device)
        state = dict(self.state_dict())
        for name, rows in (("mixing", idx), ("content_bias.weight", idx), ("v_proj.weight", v_rows),
                           ("v_proj.bias", v_rows)):  # fmt: skip
            if name in state:
                state[name] = state[name][rows]
        state["out_proj.weight"] = state["out_proj.weight"][:, v_rows]  # (out, H*Dv) -> (out, H'*Dv)
        new = type(self)(self.embed_dim, len(heads), head_dim=self.head_dim, device="meta",
                         dtype=self.out_proj.weight.dtype, **self.init_options)  # fmt: skip
        return load_selected(new, state, self)

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
        case): D̃ = H·D, CONCATENATE mixing, ``scale = 1/sqrt(D)`` and the
        weights of ``collaborative_compress.exact_weights`` (W_Q and W_K
        copied, GQA key/value heads repeated to H, the query bias turned into
        the content bias); the output projection is copied. With
        ``shared_dim=r`` the exact module is then compressed with
        :meth:`compress` (call it directly to get the error too). The result
        has no rope and no qk_norm.

        Raises:
            TypeError: not a MultiHeadAttention.
            ValueError: ``mha`` uses rope or qk_norm (per-head rotations and
                norms over D do not re-parametrise exactly onto D̃ channels).
        """
        return collaborative_from_mha(cls, mha, shared_dim)

    def compress(self, rank: int, *, query: torch.Tensor | None = None, **forward_kwargs) -> Compression:
        """Shrink D̃ to ``rank`` by keeping the top singular directions.

        The forms A_h (:meth:`head_products`) are replaced by their best
        approximation with ``rank`` shared channels over all heads
        (``collaborative_compress.top_singular_channels``); for a module from
        :meth:`from_mha` (rank A_h ≤ D) ``rank = H·D`` is exact. Values,
        content bias, output projection and ``scale`` are kept (unlike the
        official ``swap_to_collaborative``, which rescales the logits by
        sqrt(D/D̃)).

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
        return compress_collaborative(self, rank, query=query, **forward_kwargs)

    def extra_repr(self) -> str:
        out = f", out_dim={self.out_dim}" if self.out_dim != self.embed_dim else ""
        return f"{super().extra_repr()}, shared_dim={self.shared_dim}{out}"


@register_attention("collaborative", CollaborativeAttention)
def _collaborative(
    *, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, **options
) -> CollaborativeAttention:
    if num_kv_heads is not None:
        raise ValueError(
            f"'collaborative' shares one key projection across heads; num_kv_heads={num_kv_heads} is not an option"
        )
    return CollaborativeAttention(embed_dim, num_heads, **options)
