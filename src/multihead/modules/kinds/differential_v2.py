"""Differential attention V2 (Diff Transformer V2, microsoft/unilm ``MultiheadFlashDiffV2``).

2H query heads attend over G key/value heads with the plain softmax; the
adjacent heads 2h and 2h+1 form output head h, the second subtracted with a
per-token weight::

    o_j = softmax(q_j K_{g(j)}ᵀ / sqrt(d)) V_{g(j)}      j = 0 .. 2H-1,  g(j) = j // (2H / G)
    u_h = o_2h - sigmoid(λ_h(x)) · o_2h+1                (T, d)
    λ(x) = x W_λᵀ                                        (T, H): one value per token and head, no bias

    x (B, T, C) --q_proj--> q (B, 2H, T, d)
                --k_proj, v_proj--> k, v (B, G, S, d)
      [--qk_norm (RMS over d) --> rope (over d)]
      --attention (fused kernel, 2H heads over G)--> (B, 2H, T, d)
      --o_2h - sigmoid(λ_h) o_2h+1--> (B, H, T, d) --out_proj--> (B, T, C)

No per-head norm, no λ_init, no depth; values are d wide. G must divide 2H,
not H: when it does not divide H, the two heads of a pair read different
key/value heads (H = 3, G = 2: head 2 reads kv 0, head 3 reads kv 1).
"""

from __future__ import annotations

import torch
from torch import nn

from ..._checks import positive_int
from ..base import AttentionLayer
from ..cost import AttentionCost, visible_pairs
from ..head_selection import check_head_selection, head_rows, load_selected
from ..registry import register_attention
from .differential import pair_mask, subtract_pairs

__all__ = ["DifferentialV2Attention"]


@register_attention("diff_v2")
class DifferentialV2Attention(AttentionLayer):
    """Differential attention V2: output head h = o_2h - sigmoid(λ_h(x)) · o_2h+1.

    Args:
        embed_dim: C.
        num_heads: H output heads (2H query heads).
        num_kv_heads: G key/value heads, a divisor of 2H (None: H).
        head_dim: d of queries, keys, values and outputs (default C // H).
        options: as ``AttentionLayer`` (kdim, vdim, qkv_bias, out_bias,
            dropout, rope, qk_norm, device, dtype); rope and qk_norm act on
            each of the 2H query heads and G key heads (the official code
            uses interleaved rope: ``rope={"interleaved": True}``).

    Attributes:
        q_proj [2H·d, C] (head 2h then 2h+1 of pair h), k_proj [G·d, kdim],
        v_proj [G·d, vdim], lambda_proj [H, C] (no bias), out_proj [C, H·d].

    ``return_weights`` and observers get the signed weights
    A_2h - sigmoid(λ_h) A_2h+1 [B, H, T, S] (row t sums to 1 - sigmoid(λ_h(x_t)));
    the event's q [B, 2H, T, d] and k [B, G, S, d] give the 2H score maps
    (query head j reads key head j // (2H / G)).

    Raises:
        ValueError / TypeError: invalid sizes (G not dividing 2H, C not
            divisible by H without head_dim) or a shared option.
    """

    kind = "diff_v2"
    refused_options = ("alibi", "softcap", "sinks")
    option_refusals = {
        "sinks": "its core is its own, not functional.attention's softmax with a sink column",
        "alibi": "each head subtracts two score maps (2H sub-heads); which slope each map takes is not defined",
        "softcap": "each head subtracts two softmax maps; the paper defines no soft-capping of them",
    }
    independent_heads = True
    head_independence = (
        "output head h is its two query heads 2h, 2h+1, its row of lambda_proj and its columns of out_proj; "
        "a selection keeps the key/value heads its query heads read (whole groups, or a pair on its own)"
    )

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None, **options) -> None:
        super().__init__(embed_dim, num_heads, **options)
        H, d = self.num_heads, self.head_dim
        G = H if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if (2 * H) % G:
            raise ValueError(f"num_kv_heads={G} must divide 2 * num_heads={2 * H} (the query heads)")
        self.num_kv_heads = G
        bias, factory = self.qkv_bias, self.factory
        self.q_proj = nn.Linear(embed_dim, 2 * H * d, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, G * d, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, G * d, bias=bias, **factory)
        self.lambda_proj = nn.Linear(embed_dim, H, bias=False, **factory)
        self.init_output(H * d, embed_dim)
        self.init_positions(d)

    # ------------------------------------------------------------------ forward hooks
    def project(self, query, key=None, value=None):
        """q [B, 2H, T, d], k and v [B, G, S, d] (key None: self-attention)."""
        key = query if key is None else key
        value = key if value is None else value
        (B, T, _), S = query.shape, key.shape[1]
        H, G, d = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(query).view(B, T, 2 * H, d).transpose(1, 2)  # (B, T, 2H*d) -> (B, 2H, T, d)
        k = self.k_proj(key).view(B, S, G, d).transpose(1, 2)  # (B, S, G*d) -> (B, G, S, d)
        v = self.v_proj(value).view(B, S, G, d).transpose(1, 2)  # (B, S, G*d) -> (B, G, S, d)
        return q, k, v

    def to_heads(self, query, key=None, value=None):
        """``project`` plus the queries' λ logits [B, T, H] in ``extra["lambda"]``."""
        q, k, v = self.project(query, key, value)
        return q, k, v, {"lambda": self.lambda_proj(query)}

    def core(self, q, k, v, extra, *, attn_mask, **call):
        """The fused attention on the 2H query heads, then o_2h - sigmoid(λ_h) o_2h+1.

        out [B, H, T, d]; weights [B, H, T, S] = A_2h - sigmoid(λ_h) A_2h+1 when asked.
        """
        out, weights = super().core(q, k, v, None, attn_mask=pair_mask(attn_mask, self.num_heads), **call)
        gate = torch.sigmoid(extra["lambda"]).transpose(1, 2)[..., None].to(out.dtype)  # (B, T, H) -> (B, H, T, 1)
        return subtract_pairs(out, gate), None if weights is None else subtract_pairs(weights, gate)

    def notify_observers(self, weights, q, k, mask, **call) -> None:
        """As ``AttentionLayer.notify_observers``, with a per-head mask given to the 2H query
        heads (the mask the core used): ``event.q``, ``event.k`` and ``event.attn_mask``
        rebuild the 2H score maps."""
        super().notify_observers(weights, q, k, pair_mask(mask, self.num_heads), **call)

    # ------------------------------------------------------------------ capabilities
    def select_heads(self, heads, kv_heads=None) -> DifferentialV2Attention:
        """As ``AttentionLayer.select_heads`` over the H output heads (pairs).

        The kept pairs' query heads keep the key/value heads they read: the
        smaller layer (H' pairs over the G' key/value heads they read) must
        map each of them, by j // (2H' / G'), to the same key/value head as
        this layer does by j // (2H / G). Whole key/value groups always do;
        so does a single pair, even one that reads two key/value heads.

        Raises:
            ValueError / TypeError: indices out of range, repeated or not
                ints; ``kv_heads`` other than those the pairs read; or a
                selection whose query heads would read other key/value heads.
        """
        H, G = self.num_heads, self.num_kv_heads
        keep, _ = check_head_selection(heads, None, H, H)  # indices only: the rule is checked below
        r = 2 * H // G
        queries = [j for h in keep for j in (2 * h, 2 * h + 1)]
        reads = [j // r for j in queries]
        keep_kv = sorted(set(reads))
        if kv_heads is not None:
            given, _ = check_head_selection(kv_heads, None, G, G)
            if given != keep_kv:
                raise ValueError(f"kv_heads={given} must be the key/value heads that heads={keep} read: {keep_kv}")
        G2, Q2 = len(keep_kv), len(queries)
        if Q2 % G2 or [keep_kv[j // (Q2 // G2)] for j in range(Q2)] != reads:
            raise ValueError(
                f"'diff_v2' attention: query head j reads key/value head j // {r}; heads={keep} keep query heads "
                f"{queries} read key/value heads {reads}, which {len(keep)} pairs over {G2} key/value heads would "
                "not; keep whole key/value groups"
            )
        return self.subset_heads(keep, keep_kv)

    def subset_heads(self, heads: list[int], kv_heads: list[int]) -> DifferentialV2Attention:
        """The kept pairs' q rows (2d each), λ rows and out_proj columns, their groups' k and v rows."""
        d, dev = self.head_dim, self.out_proj.weight.device
        q_rows, kv_rows = head_rows(heads, 2 * d, dev), head_rows(kv_heads, d, dev)
        rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows,
                "lambda_proj": torch.tensor(heads, dtype=torch.long, device=dev)}  # fmt: skip
        state = {n: t[rows[n.split(".")[0]]] if n.split(".")[0] in rows else t for n, t in self.state_dict().items()}
        state["out_proj.weight"] = state["out_proj.weight"][:, head_rows(heads, d, dev)]  # (C, H*d) -> (C, H'*d)
        new = type(self)(self.embed_dim, len(heads), num_kv_heads=len(kv_heads), head_dim=d,
                         device="meta", dtype=self.out_proj.weight.dtype, **self.init_options)  # fmt: skip
        return load_selected(new, state, self)

    def cost(self, T: int, S: int | None = None, *, batch: int = 1, causal: bool = False,
             bytes_per_element: int = 2) -> AttentionCost:  # fmt: skip
        """FLOPs, parameters and cache bytes of one call (``modules.cost`` conventions).

        core = 2·B·2H·P·(d + d) with P visible (query, key) pairs;
        projections = 2·B·(T·C·2H·d + S·kdim·G·d + S·vdim·G·d + T·C·H + T·H·d·C)
        (T·C·H: lambda_proj). The subtraction, sigmoid, rope and qk_norm are
        not counted. The cache holds 2·G·d numbers per token.
        """
        S = T if S is None else S
        H, G, d, C = self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim
        core = 2 * batch * 2 * H * visible_pairs(T, S, causal=causal, window=self.sliding_window) * (d + d)
        proj = 2 * batch * (T * C * 2 * H * d + S * (self.kdim + self.vdim) * G * d + T * C * H + T * H * d * C)
        params = sum(p.numel() for p in self.parameters())
        return AttentionCost(core, proj, params, 2 * G * d * bytes_per_element)
