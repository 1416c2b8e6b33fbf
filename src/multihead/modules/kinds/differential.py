"""Differential attention V1 (Ye et al. 2024, "Differential Transformer", arXiv:2410.05258).

Each head h has two query sub-heads and two key sub-heads of width d, and
one value head of width 2d; its weights are the difference of two softmaxes::

    A1 = softmax(Q1 K1ᵀ / sqrt(d)),  A2 = softmax(Q2 K2ᵀ / sqrt(d))        (T, S) each
    head_h = (1 - λ_init) · RMSNorm((A1 - λ A2) V)                         (T, 2d)
    λ = exp(λq1 · λk1) - exp(λq2 · λk2) + λ_init                          one scalar per layer
    λ_init(depth) = 0.8 - 0.6 · exp(-0.3 · depth)

    x (B, T, C) --q_proj--> q (B, 2H, T, d)      sub-heads 2h, 2h+1 belong to head h
                --k_proj--> k (B, 2G, S, d)
                --v_proj--> v (B, G, S, 2d)
      [--qk_norm (RMS over d) --> rope (over d, each sub-head)]
      --attention on the 2H sub-heads (fused kernel)--> (B, 2H, T, 2d)
      --o_2h - λ o_2h+1--> (B, H, T, 2d) --RMSNorm(2d), x (1 - λ_init)--> out_proj --> (B, T, C)

Key sharing follows the official ``repeat_kv``: query sub-head j reads key
sub-head j // (H / G) and head h reads value head h // (H / G), so with
G < H the two halves of a head can read the same key sub-head. The fast
path multiplies each softmax by the values and subtracts the results
(linear, so equal to (A1 - λ A2) V); its KV cache holds the 2G key
sub-heads and the G value heads, 4·G·d numbers per token.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from ..base import AttentionLayer
from ..cost import AttentionCost, visible_pairs
from ..head_selection import head_rows, load_selected
from ..kv_cache import KVCache
from ..norms import HeadRMSNorm
from ..registry import register_attention

__all__ = ["DifferentialAttention", "lambda_init_for_depth", "pair_mask", "subtract_pairs"]


def lambda_init_for_depth(depth: int) -> float:
    """λ_init = 0.8 - 0.6·exp(-0.3·depth) of the layer at ``depth`` (0 for the first)."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


def pair_mask(mask: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """A mask for H heads made one for their 2H sub-heads (both halves of head h get head h's rows).

    mask: None, (T, S), or 4-D (B|1, H|1, T, S) -> (B|1, 2H|1, T, S).

    Raises:
        ValueError: a 4-D mask whose head dimension is neither 1 nor H.
    """
    if mask is None or mask.dim() != 4 or mask.shape[1] == 1:
        return mask
    if mask.shape[1] != num_heads:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to (B, H={num_heads}, T, S)")
    return mask.repeat_interleave(2, dim=1)  # (B, H, T, S) -> (B, 2H, T, S)


def subtract_pairs(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """x [B, 2H, T, W] -> x[:, 2h] - factor · x[:, 2h+1], [B, H, T, W]
    (factor a 0-d tensor or [B, H, T, 1])."""
    return x[:, 0::2] - factor * x[:, 1::2]


@register_attention("diff")
class DifferentialAttention(AttentionLayer):
    """Differential attention (V1): each head is softmax(Q1 K1ᵀ) - λ softmax(Q2 K2ᵀ) times its values.

    Args:
        embed_dim: C.
        num_heads: H differential heads (the paper's h, half a Transformer's heads).
        num_kv_heads: G key/value heads dividing H (None: H), each 2 key
            sub-heads of width d and one value head of width 2d.
        head_dim: d, the width of a query/key sub-head (default C // (2H),
            the official size); values and head outputs are 2d wide.
        depth: the layer's index in its stack (0 for the first), giving
            λ_init = 0.8 - 0.6·exp(-0.3·depth).
        options: as ``AttentionLayer`` (kdim, vdim, qkv_bias, out_bias,
            dropout, rope, qk_norm, device, dtype); rope and qk_norm act on
            each d-wide sub-head of q and k (the official code uses
            interleaved rope: ``rope={"interleaved": True}``); dropout acts
            on each of the two softmaxes in training mode.

    Attributes:
        q_proj [2H·d, C], k_proj [2G·d, kdim], v_proj [2G·d, vdim] (value
            head g is rows 2g·d .. 2(g+1)·d), out_proj [C, 2H·d].
        lambda_q1, lambda_k1, lambda_q2, lambda_k2: [d] each, drawn from N(0, 0.1²).
        lambda_init: the float λ_init; subln: the RMSNorm over 2d (eps 1e-5, no gain).

    ``return_weights`` and observers get the signed weights A1 - λ A2
    [B, H, T, S] of each head (rows sum to 1 - λ), before the norm; the
    event's q [B, 2H, T, d] and k [B, 2G, S, d] are the sub-heads, whose
    scaled products are the 2H score maps (sub-head j reads key j // (H/G)).

    Raises:
        ValueError / TypeError: invalid sizes (C not divisible by 2H without
            head_dim), depth, or a shared option.
    """

    kind = "diff"
    refused_options = ("alibi", "softcap", "sinks")
    option_refusals = {
        "sinks": "its core is its own, not functional.attention's softmax with a sink column",
        "alibi": "each head subtracts two score maps (2H sub-heads); which slope each map takes is not defined",
        "softcap": "each head subtracts two softmax maps; the paper defines no soft-capping of them",
    }
    layer_index_option = "depth"  # λ_init grows with the layer's depth
    independent_heads = True
    head_independence = (
        "a head's two query sub-heads, its value head and its 2d columns of out_proj go together, its norm is "
        "its own and λ is one scalar that every head keeps; with G < H a selection keeps whole key/value groups"
    )

    def __init__(self, embed_dim: int, num_heads: int, *, depth: int = 0, head_dim: int | None = None,
                 **options) -> None:  # fmt: skip
        if head_dim is None and isinstance(embed_dim, int) and isinstance(num_heads, int) and num_heads > 0:
            if embed_dim % (2 * num_heads):
                raise ValueError(f"embed_dim={embed_dim} is not divisible by 2 * num_heads={2 * num_heads}; "
                                 "pass head_dim explicitly")  # fmt: skip
            head_dim = embed_dim // (2 * num_heads)
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or depth < 0:
            raise ValueError(f"depth must be an int >= 0 (the layer's index), got depth={depth!r}")
        super().__init__(embed_dim, num_heads, head_dim=head_dim, **options)
        H, G, d = self.num_heads, self.num_kv_heads, self.head_dim
        self.depth = int(depth)
        self.lambda_init = lambda_init_for_depth(self.depth)
        self.init_options["depth"] = self.depth
        bias, factory = self.qkv_bias, self.factory
        self.q_proj = nn.Linear(embed_dim, 2 * H * d, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, 2 * G * d, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, 2 * G * d, bias=bias, **factory)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.empty(d, **factory)))
        self.reset_lambda()
        self.subln = HeadRMSNorm(2 * d, eps=1e-5, elementwise_affine=False)
        self.init_output(2 * H * d, embed_dim)
        self.init_positions(d)

    def reset_lambda(self) -> None:
        """λq1, λk1, λq2, λk2 ~ N(0, 0.1²) from torch's global generator (as the official code)."""
        with torch.no_grad():
            for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
                p.normal_(0.0, 0.1)

    def lambda_full(self) -> torch.Tensor:
        """λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init, a 0-d tensor with its gradient
        (computed in at least float32)."""
        dt = torch.promote_types(self.lambda_q1.dtype, torch.float32)
        dot1 = (self.lambda_q1.to(dt) * self.lambda_k1.to(dt)).sum()
        dot2 = (self.lambda_q2.to(dt) * self.lambda_k2.to(dt)).sum()
        return torch.exp(dot1) - torch.exp(dot2) + self.lambda_init

    # ------------------------------------------------------------------ forward hooks
    def project(self, query, key=None, value=None):
        """q [B, 2H, T, d], k [B, 2G, S, d], v [B, G, S, 2d] (key None: self-attention)."""
        key = query if key is None else key
        value = key if value is None else value
        (B, T, _), S = query.shape, key.shape[1]
        H, G, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).view(B, T, 2 * H, d).transpose(1, 2)  # (B, T, 2H*d) -> (B, 2H, T, d)
        k = self.k_proj(key).view(B, S, 2 * G, d).transpose(1, 2)  # (B, S, 2G*d) -> (B, 2G, S, d)
        v = self.v_proj(value).view(B, S, G, 2 * d).transpose(1, 2)  # (B, S, G*2d) -> (B, G, S, 2d)
        return q, k, v

    def core(self, q, k, v, extra, *, attn_mask, **call):
        """The fused attention on the 2H sub-heads, then o_2h - λ o_2h+1, RMSNorm and (1 - λ_init).

        out [B, H, T, 2d]; weights [B, H, T, S] = A1 - λ A2 (signed) when asked.
        """
        v = v.repeat_interleave(2, dim=1)  # (B, G, S, 2d) -> (B, 2G, S, 2d): sub-head j of k reads value j // 2
        out, weights = super().core(q, k, v, None, attn_mask=pair_mask(attn_mask, self.num_heads), **call)
        lam = self.lambda_full().to(out.dtype)
        out = self.subln(subtract_pairs(out, lam)) * (1.0 - self.lambda_init)  # (B, 2H, T, 2d) -> (B, H, T, 2d)
        return out, None if weights is None else subtract_pairs(weights, lam)

    def make_kv_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None):
        """Keys (batch_size, 2G, max_len, d) and values (batch_size, G, max_len, 2d)."""
        ref = self.out_proj.weight
        G, d = self.num_kv_heads, self.head_dim
        return KVCache(batch_size, 2 * G, max_len, d, value_dim=2 * d, value_heads=G,
                       dtype=dtype or ref.dtype, device=device or ref.device)  # fmt: skip

    def notify_observers(self, weights, q, k, mask, **call) -> None:
        """As ``AttentionLayer.notify_observers``, with a per-head mask given to the 2H query
        heads (the mask the core used): ``event.q``, ``event.k`` and ``event.attn_mask``
        rebuild the 2H score maps."""
        super().notify_observers(weights, q, k, pair_mask(mask, self.num_heads), **call)

    # ------------------------------------------------------------------ capabilities
    def subset_heads(self, heads: list[int], kv_heads: list[int]) -> DifferentialAttention:
        """The kept heads' q rows (2d each), their groups' k and v rows (2d each), out_proj
        columns, and λ's vectors whole.

        Raises:
            ValueError: with G < H, a selection that keeps part of a group
                (the sub-heads would then read other key sub-heads).
        """
        H, G, d = self.num_heads, self.num_kv_heads, self.head_dim
        if len(heads) * G != len(kv_heads) * H:
            raise ValueError(
                f"'diff' attention with {H // G} heads per key/value head keeps whole groups (query sub-head j "
                f"reads key sub-head j // {H // G}); heads={heads} keep {len(heads)} heads of groups {kv_heads}"
            )
        dev = self.out_proj.weight.device
        q_rows, kv_rows = head_rows(heads, 2 * d, dev), head_rows(kv_heads, 2 * d, dev)
        rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        state = {n: t[rows[n.split(".")[0]]] if n.split(".")[0] in rows else t for n, t in self.state_dict().items()}
        state["out_proj.weight"] = state["out_proj.weight"][:, q_rows]  # (C, 2H*d) -> (C, 2H'*d)
        new = type(self)(self.embed_dim, len(heads), num_kv_heads=len(kv_heads), head_dim=d,
                         device="meta", dtype=self.out_proj.weight.dtype, **self.init_options)  # fmt: skip
        return load_selected(new, state, self)

    def cost(self, T: int, S: int | None = None, *, batch: int = 1, causal: bool = False,
             bytes_per_element: int = 2) -> AttentionCost:  # fmt: skip
        """FLOPs, parameters and cache bytes of one call (``modules.cost`` conventions).

        core = 2·B·2H·P·(d + 2d): the fused path's 2H score maps and 2H
        products with the 2d-wide values, P visible (query, key) pairs;
        projections = 2·B·(T·C·2H·d + S·kdim·2G·d + S·vdim·2G·d + T·2H·d·C).
        The subtraction, λ, the norm, rope and qk_norm are elementwise and
        not counted. The cache holds 2G·d key and 2G·d value numbers per token.
        """
        S = T if S is None else S
        H, G, d, C = self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim
        core = 2 * batch * 2 * H * visible_pairs(T, S, causal=causal, window=self.sliding_window) * (d + 2 * d)
        proj = 2 * batch * (T * C * 2 * H * d + S * (self.kdim + self.vdim) * 2 * G * d + T * 2 * H * d * C)
        params = sum(p.numel() for p in self.parameters())
        return AttentionCost(core, proj, params, 4 * G * d * bytes_per_element)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, depth={self.depth}, lambda_init={self.lambda_init:.4g}"
