"""DCMHA (dynamically composable multi-head attention) and Talking-Heads.

DCMHA (Xiao et al., ICML 2024; official code Caiyun-AI/DCFormer) keeps the
per-head q/k/v projections of MHA and composes the H per-head scores of
every (query t, key s) pair across heads twice: on the scaled logits before
the softmax and on the probabilities after it::

    x (B, T, C) --qkv_proj--> q, k, v (B, H, T, D)
    S  = (q / sqrt(D)) kᵀ                      (B, H, T, S)
    L  = Compose(S; slots 0, 1)  -> mask -> softmax over keys = P
    P' = Compose(P; slots 2, 3)  -> P' v -> merge heads -> out_proj

    Compose: A'[:, t, s] = A[:, t, s] @ M[t, s],  M[t, s] = N x N =
        I + W_static + diag(qdd_t + kdd_s) + qw1_tᵀ qw2_t + kw1_sᵀ kw2_s

The query-side weights (qw1, qw2 [R, H], qdd [H]) are generated from the
query token, the key-side ones from the key token (``_dynamic``), R = 2.
Talking-Heads attention (Shazeer et al., 2020) is the static special case
M = P_l before and M = P_w after the softmax (no identity, no dynamics).

**Chunking.** Composition mixes heads only at the same (t, s), and the
key-side weights depend only on the key token, so blocks of queries are
independent: the module runs over blocks of ``chunk_size`` queries (auto:
256 when T > 256) and never holds more than (B, H, chunk, S) scores; with
``is_causal`` a block also skips the keys no query of it may see. The
result equals the unchunked computation (tested to 1e-10 in float64).
Training still keeps each block's activations for backward.

**Rope and QK-norm** (``rope=``, ``qk_norm=``, off by default): applied
to the per-head q [B, H, T, D] and k [B, H, S, D] right after
``qkv_proj``, per head over the head dim D, in DCFormer's order
project -> qk_norm -> rope -> scores (v untouched), before the KV-cache
write (the cache holds rotated keys). The dynamic composition weights come
from the token states x, not from q/k, so the options leave them unchanged.

**Masks** (bool True = may attend, or float added): applied after
pre-Compose, as in the official code; hidden entries of P' are set to 0
after post-Compose, which changes nothing for masks shared by all heads (P
is 0 there for every head) and keeps a per-head mask from leaking keys a
head may not see.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..._checks import positive_int
from ..base import AttentionLayer
from ..cost import AttentionCost, visible_pairs
from ..kv_cache import DynamicKVCache, KVCache
from ..projections import fused_qkv, split_heads
from ..registry import register_attention
from .dcmha_core import composed_attention

__all__ = ["DCMHA", "TalkingHeadsAttention", "AUTO_CHUNK"]

AUTO_CHUNK = 256  # queries per block when chunk_size is None and T > AUTO_CHUNK


class DCMHA(AttentionLayer):
    """Dynamically composable multi-head attention.

    Args:
        embed_dim: C.
        num_heads: H.
        head_dim: D (default C // H).
        rank: R, rank of each dynamic query-/key-wise projection (2 in DCFormer).
        dynamic_hidden_dim: K, hidden width of the weight generator (default 4H).
        dynamic: generate the dynamic terms (False: static composition only).
        static: learn static H x H matrices ``pre_static``/``post_static``
            (zero-initialised for DCMHA: composition starts as the identity).
        residual: add the identity to both compositions.
        chunk_size: queries per block (None: ``AUTO_CHUNK`` when T exceeds it,
            else one block); any value >= T runs unchunked.
        qkv_bias, out_bias: biases of the projections.
        dropout: on the composed weights P' in training mode.
        rope: rotary position embeddings on q and k after the projection
            (True: base 10000 on all D channels, rotate-half pairs as
            DCFormer; or a dict of ``apply_rope`` options ``base``,
            ``interleaved``, ``rotary_dim``); enables ``positions`` in
            ``forward``.
        qk_norm: RMS-normalise each query and key head over D (eps 1e-6)
            with learned gains ``qk_norm.q_norm.weight`` /
            ``qk_norm.k_norm.weight`` [D] (DCFormer's ``use_qk_norm``),
            before rope.
        device, dtype: of the parameters.

    The forward is ``AttentionLayer.forward`` (arguments, masks and cache as
    :class:`MultiHeadAttention`, widths C; key tokens also generate the
    key-side weights, and :meth:`make_kv_cache` stores them). ``backend`` is
    "auto" or "math" (the composed core has one path; "sdpa" is refused).
    ``return_weights`` gives P' [B, H, T, S], the post-composed
    probabilities that multiply the values (not renormalised, may be
    negative; 0 at hidden keys); observers get the same, with the
    normalised, rotated q and k.

    Parameters (official DCFormer layout): ``dw1`` [C, 4, K], ``qkw``
    [4, K, 2R, H], ``dd`` [C, 4, H] with slots 0 = pre/query, 1 = pre/key,
    2 = post/query, 3 = post/key.

    Raises:
        ValueError: invalid sizes, dropout or chunk_size (values named).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        rank: int = 2,
        dynamic_hidden_dim: int | None = None,
        dynamic: bool = True,
        static: bool = True,
        residual: bool = True,
        chunk_size: int | None = None,
        **options,
    ) -> None:
        super().__init__(embed_dim, num_heads, **options)
        H, D = self.num_heads, self.head_dim
        self.rank = positive_int("rank", rank)
        self.dynamic_hidden_dim = 4 * H if dynamic_hidden_dim is None else positive_int(
            "dynamic_hidden_dim", dynamic_hidden_dim
        )
        if not dynamic and not static:
            raise ValueError("dynamic=False and static=False leave nothing to compose; use 'mha'")
        self.dynamic, self.static, self.residual = bool(dynamic), bool(static), bool(residual)
        self.chunk_size = None if chunk_size is None else positive_int("chunk_size", chunk_size)
        factory = self.factory
        self.qkv_proj = nn.Linear(embed_dim, 3 * H * D, bias=self.qkv_bias, **factory)
        self.init_output(H * D, embed_dim)
        if self.static:
            init = torch.zeros if residual else (lambda *s, **f: torch.eye(H, **f))
            self.pre_static = nn.Parameter(init(H, H, **factory))
            self.post_static = nn.Parameter(init(H, H, **factory))
        if self.dynamic:
            K, R, C = self.dynamic_hidden_dim, self.rank, embed_dim
            # Official initialisation (DCFormer's DynamicWeightProjection).
            self.dw1 = nn.Parameter(torch.randn(C, 4, K, **factory) * math.sqrt(2 / (C + K)))
            self.qkw = nn.Parameter(torch.randn(4, K, 2 * R, H, **factory) * (0.02 / (math.sqrt(4 * H) * (H + 2))))
            self.dd = nn.Parameter(torch.randn(C, 4, H, **factory) * (0.05 * math.sqrt(2 / (H + C))))
        self.init_positions(D)

    kind = "dcmha"
    refused_options = ("num_kv_heads", "kdim", "vdim", "alibi", "softcap", "sinks")  # H key heads from one fused projection
    option_refusals = {
        "sinks": "its core is its own, not functional.attention's softmax with a sink column",
        "alibi": "the composed core mixes every head's scores, so a per-head ALiBi bias has no defined place in it",
        "softcap": "the composed core forms its own scores (functional.attention's soft-capping is not applied there)",
    }
    backends = ("auto", "math")  # composition needs the scores themselves: no fused kernel
    head_independence = (
        "the composition mixes heads: every head's scores and weights are combined with every other head's "
        "(H x H transforms before and after the softmax), so each head's output depends on all heads"
    )

    # ------------------------------------------------------------------ pieces
    def project(self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None):
        """q [B, H, T, D], k and v [B, H, S, D] from the inputs (key=None: self)."""
        HD = self.num_heads * self.head_dim
        q, k, v = fused_qkv(self.qkv_proj, query, key, value, (HD, HD, HD))
        return tuple(split_heads(t, self.num_heads) for t in (q, k, v))

    def to_heads(self, query, key=None, value=None):
        """q, k, v and the composition weights: ``extra`` = {"qw": from the query
        tokens, "kw": from the key tokens} ([B, L, 2, 2R + 1, H] or None)."""
        q, k, v = self.project(query, key, value)
        qw = self.dynamic_weights(query, "query")
        kw = self.dynamic_weights(query if key is None else key, "key")
        return q, k, v, {"qw": qw, "kw": kw}

    def dynamic_weights(self, x: torch.Tensor, side: str) -> torch.Tensor | None:
        """Composition weights of ``side`` ("query": slots 0, 2; "key": 1, 3).

        h = GELU(x·dw1[:, c]); W = h·qkw[c] = [w1 | w2]; w1 RMS-normalised
        over heads (eps 1e-6, no gain); dd = tanh(x·dd[:, c]).

        Returns:
            [B, L, 2, 2R + 1, H] (pre, post; rows w1 | w2 | dd), or None
            when the module is static-only.
        """
        if not self.dynamic:
            return None
        R = self.rank
        first = 0 if side == "query" else 1
        h = F.gelu(torch.einsum("blc,cjk->bljk", x, self.dw1[:, first::2]))  # (B, L, 2, K)
        w = torch.einsum("bljk,jkrn->bljrn", h, self.qkw[first::2])  # (B, L, 2, 2R, H)
        w1, w2 = w[:, :, :, :R], w[:, :, :, R:]
        w1 = w1 * torch.rsqrt(w1.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
        gate = torch.tanh(torch.einsum("blc,cjn->bljn", x, self.dd[:, first::2]))  # (B, L, 2, H)
        return torch.cat([w1, w2, gate.unsqueeze(3)], dim=3)

    def _chunk(self, T: int) -> int:
        if self.chunk_size is not None:
            return self.chunk_size
        return AUTO_CHUNK if T > AUTO_CHUNK else max(T, 1)

    # ------------------------------------------------------------------ core
    def attend(self, q, k, v, qw, kw, **call) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The composed attention core (``dcmha_core.composed_attention``).

        Args:
            q: [B, H, T, D]; k: [B, H, S, D]; v: [B, H, S, Dv].
            qw: [B, T, 2, 2R+1, H] query-side and kw: [B, S, 2, 2R+1, H]
                key-side weights from :meth:`dynamic_weights` (None: static).
            call: attn_mask, is_causal, causal_alignment, return_weights.

        Returns:
            (out [B, H, T, Dv], weights P' [B, H, T, S] or None).
        """
        return composed_attention(
            q, k, v, qw, kw, rank=self.rank, residual=self.residual,
            pre_static=self.pre_static if self.static else None,
            post_static=self.post_static if self.static else None,
            chunk=self._chunk(q.shape[-2]), dropout_p=self.dropout, training=self.training, **call,
        )  # fmt: skip

    # ------------------------------------------------------------------ forward
    def make_kv_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None
    ) -> KVCache:
        """A cache for keys, values and (DCMHA) the key-side composition weights."""
        ref = self.out_proj.weight
        kw = {"dtype": dtype or ref.dtype, "device": device or ref.device}
        if not self.dynamic:
            return KVCache(batch_size, self.num_heads, max_len, self.head_dim, **kw)
        return DynamicKVCache(batch_size, self.num_heads, max_len, self.head_dim, self.rank, **kw)

    def write_cache(self, cache: KVCache, k, v, extra):
        """Keys, values and (dynamic) the key-side weights of every cached token."""
        if not self.dynamic:
            return super().write_cache(cache, k, v, extra)
        k, v, kw = cache.update(k, v, extra["kw"])
        return k, v, {**extra, "kw": kw}

    def core(self, q, k, v, extra, *, backend, **call):
        """:meth:`attend` with this call's composition weights (one path for any backend)."""
        return self.attend(q, k, v, extra["qw"], extra["kw"], **call)

    def cost(
        self, T: int, S: int | None = None, *, batch: int = 1, causal: bool = False, bytes_per_element: int = 2
    ) -> AttentionCost:
        """FLOPs, parameters and cache bytes of one call (``modules.cost`` conventions).

        With P visible pairs, B batch, H heads, D head dim, R rank, K hidden:

        * core = 2·B·H·P·2D (scores, values)
          + 2 compositions x B·P·(8·R·H·[dynamic] + 2·H²·[static]):
          per pair, the query- and key-wise low-rank terms each project
          H -> R and back (4 products of R·H multiply-adds), the static
          matrix is H² multiply-adds; gates and the identity are
          elementwise and not counted;
        * projections = 2·B·(T + 2S)·C·H·D + 2·B·T·H·D·C (q, k, v, out)
          + weight generation per token and side (2 slots):
          2·B·(T + S)·2·(C·K + K·2R·H + C·H).
        * cache per token: keys and values 2·H·D, plus (dynamic) 2·(2R + 1)·H
          key-side weights.
        * rope and qk_norm are elementwise and not counted; the qk_norm
          gains (2·D) are among the parameters.
        """
        S = T if S is None else S
        H, D, C, R, K = self.num_heads, self.head_dim, self.embed_dim, self.rank, self.dynamic_hidden_dim
        pairs = visible_pairs(T, S, causal=causal, window=self.sliding_window)
        per_pair = (8 * R * H if self.dynamic else 0) + (2 * H * H if self.static else 0)
        core = 2 * batch * H * pairs * 2 * D + 2 * batch * pairs * per_pair
        proj = 2 * batch * (T + 2 * S) * C * H * D + 2 * batch * T * H * D * C
        cache = 2 * H * D
        if self.dynamic:
            proj += 2 * batch * (T + S) * 2 * (C * K + K * 2 * R * H + C * H)
            cache += 2 * (2 * R + 1) * H
        params = sum(p.numel() for p in self.parameters())
        return AttentionCost(core, proj, params, cache * bytes_per_element)

    def extra_repr(self) -> str:
        parts = [super().extra_repr()]
        if self.dynamic:
            parts.append(f"rank={self.rank}, dynamic_hidden_dim={self.dynamic_hidden_dim}")
        parts.append(f"static={self.static}, residual={self.residual}, chunk_size={self.chunk_size}")
        return ", ".join(parts)


class TalkingHeadsAttention(DCMHA):
    """Talking-Heads attention (Shazeer et al., 2020, arXiv:2003.02436).

    L' = L·P_l across heads before the softmax and P' = softmax(L')·P_w
    after it, with learned H x H matrices ``pre_static`` (P_l) and
    ``post_static`` (P_w) initialised to the identity (so it starts as MHA).
    It is ``DCMHA(dynamic=False, static=True, residual=False)``; this
    implementation uses H heads throughout (the paper allows different
    numbers of logit and weight heads).
    """

    kind = "talking_heads"
    _FIXED = ("dynamic", "static", "residual", "rank", "dynamic_hidden_dim")  # DCMHA's, set here
    refused_options = DCMHA.refused_options + _FIXED

    def __init__(self, embed_dim: int, num_heads: int, **options) -> None:
        fixed = {name: options[name] for name in self._FIXED if name in options}
        if fixed:
            raise TypeError(f"{type(self).__name__} does not take {', '.join(fixed)} (got {fixed}); use 'dcmha'")
        super().__init__(embed_dim, num_heads, dynamic=False, static=True, residual=False, **options)


def _no_kv_heads(name: str, num_heads: int, options: dict) -> None:
    G = options.pop("num_kv_heads", None)
    if G not in (None, num_heads):
        raise ValueError(f"{name!r} needs num_kv_heads == num_heads={num_heads}; got num_kv_heads={G}")


@register_attention("dcmha", DCMHA)
def _dcmha(*, embed_dim: int, num_heads: int, **options) -> DCMHA:
    _no_kv_heads("dcmha", num_heads, options)
    return DCMHA(embed_dim, num_heads, **options)


@register_attention("talking_heads", TalkingHeadsAttention)
def _talking_heads(*, embed_dim: int, num_heads: int, **options) -> TalkingHeadsAttention:
    _no_kv_heads("talking_heads", num_heads, options)
    return TalkingHeadsAttention(embed_dim, num_heads, **options)
