"""The production multi-head attention module: MHA, GQA and MQA.

    x (B, T, C) --qkv_proj--> q (B, H, T, D), k/v (B, G, S, D)
      --functional.attention--> (B, H, T, D) --merge heads--> (B, T, H*D)
      --out_proj--> (B, T, C)

Self-attention uses one fused projection ``qkv_proj`` whose output rows are
[q heads | k heads | v heads]; cross-attention with the same widths uses the
same matrix in two slices; with ``kdim``/``vdim`` different from
``embed_dim`` there are three projections ``q_proj``, ``k_proj``,
``v_proj``. State dicts in the split layout (``q_proj``, ``k_proj``,
``v_proj``) load into the fused layout and the other way round.

Two optional position/normalisation steps sit between the projections and
the attention core, in this order (both off by default, and then nothing
changes):

    project -> qk_norm (per-head RMSNorm of q and k) -> rope (rotate q and k)
      -> attention

With a KV cache the keys are cached after both steps, so each token is
normalised and rotated once, at its own position.
"""

from __future__ import annotations

import torch
from torch import nn

from ..base import AttentionLayer
from ..cost import AttentionCost, visible_pairs
from ..head_selection import head_rows, load_selected
from ..projections import fused_qkv, split_heads
from ..registry import register_attention

__all__ = ["MultiHeadAttention"]

_SPLIT = ("q_proj", "k_proj", "v_proj")
_NORMS = ("q_norm", "k_norm")

class MultiHeadAttention(AttentionLayer):
    """Multi-head attention with grouped key/value heads, masks and a KV cache.

    Args:
        embed_dim: C, the model width of queries and outputs.
        num_heads: H query heads.
        num_kv_heads: G key/value heads (None: G = H; 1: MQA). G divides H;
            query head h reads key/value head h // (H // G).
        head_dim: D (default C // H).
        kdim, vdim: widths of key and value inputs (default C).
        qkv_bias, out_bias: biases of the input and output projections.
        dropout: dropout on the attention weights in training mode.
        rope: rotary position embeddings on q and k (``functional.rope``):
            False (off), True (base 10000, rotate-half pairing, all D
            channels) or a dict of ``apply_rope`` options ``base``,
            ``interleaved``, ``rotary_dim``. Positions are 0 .. T-1, offset
            by the cache length when decoding with a KV cache, or the
            ``positions`` argument of ``forward``.
        qk_norm: RMS-normalise each query and key head over D with learned
            gains ``qk_norm.q_norm.weight`` and ``qk_norm.k_norm.weight``
            [D] (``modules.norms.QKNorm``; OLMo-2 / Qwen3 style).
        device, dtype: of the parameters.

    Order inside forward: project -> qk_norm -> rope -> attention.

    Attributes:
        kind: registry name. The class attribute is the family name "mha";
            ``__init__`` sets the instance's name from G: "mha" (G = H),
            "mqa" (G = 1) or "gqa" (otherwise). A subclass that declares
            its own class attribute (``GatedHeadAttention.kind == "gated"``)
            keeps it.

    Raises:
        ValueError: invalid sizes, dropout or rope options (the message
            names the values).
    """

    kind = "mha"
    independent_heads = True
    weight_only_layers = True  # q|k|v and out_proj are nn.Linear modules it calls
    regroups_key_values = True  # G plain key/value heads: to_gqa and to_mla rebuild them
    head_independence = (
        "each head attends with its own query (and its group's key/value) rows and reaches the output only "
        "through its own columns of out_proj; a key/value head goes with its whole group"
    )

    @classmethod
    def comparison_options(cls, kind: str, num_heads: int) -> dict:
        """"gqa": half as many key/value heads as query heads (at least 1); "mha", "mqa": none."""
        return {"num_kv_heads": max(1, num_heads // 2)} if kind == "gqa" else {}

    @classmethod
    def kind_name(cls, num_heads: int, num_kv_heads: int) -> str:
        """The registered name of this attention with H query and G key/value heads:
        a subclass that declares its own ``kind`` keeps it; the family's is "mha"
        (G = H), "mqa" (G = 1 < H) or "gqa" (otherwise)."""
        if cls.kind != MultiHeadAttention.kind:
            return cls.kind
        return "mha" if num_kv_heads == num_heads else "mqa" if num_kv_heads == 1 else "gqa"

    def __init__(self, embed_dim: int, num_heads: int, **options) -> None:
        super().__init__(embed_dim, num_heads, **options)
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        if type(self).kind == MultiHeadAttention.kind:  # the family's per-instance name
            self.kind = MultiHeadAttention.kind_name(H, G)
        bias, factory = self.qkv_bias, self.factory
        self.fused = self.kdim == embed_dim and self.vdim == embed_dim
        if self.fused:
            self.qkv_proj = nn.Linear(embed_dim, (H + 2 * G) * D, bias=bias, **factory)
        else:
            self.q_proj = nn.Linear(embed_dim, H * D, bias=bias, **factory)
            self.k_proj = nn.Linear(self.kdim, G * D, bias=bias, **factory)
            self.v_proj = nn.Linear(self.vdim, G * D, bias=bias, **factory)
        self.init_output(H * D, embed_dim)
        self.init_positions(D)
        self._register_load_state_dict_pre_hook(self._load_split_layout)

    # ------------------------------------------------------------------ weights
    def _slices(self) -> tuple[slice, slice, slice]:
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        return slice(0, H * D), slice(H * D, (H + G) * D), slice((H + G) * D, (H + 2 * G) * D)

    def _load_split_layout(self, state_dict, prefix, *args) -> None:
        """Accept q_proj/k_proj/v_proj keys for a fused module and qkv_proj keys
        for a split one, and Hugging Face's flat ``q_norm.weight`` /
        ``k_norm.weight`` (Qwen3, OLMo-2 per-head norms) for
        ``qk_norm.q_norm.weight`` / ``qk_norm.k_norm.weight``, converting in
        place before the normal load."""
        if self.qk_norm is not None:
            for n in _NORMS:
                if f"{prefix}{n}.weight" in state_dict and f"{prefix}qk_norm.{n}.weight" not in state_dict:
                    state_dict[f"{prefix}qk_norm.{n}.weight"] = state_dict.pop(f"{prefix}{n}.weight")
        for suffix in ("weight", "bias"):
            names = [f"{prefix}{n}.{suffix}" for n in _SPLIT]
            if self.fused and all(n in state_dict for n in names):
                state_dict[f"{prefix}qkv_proj.{suffix}"] = torch.cat([state_dict.pop(n) for n in names])
            elif not self.fused and f"{prefix}qkv_proj.{suffix}" in state_dict:
                whole = state_dict.pop(f"{prefix}qkv_proj.{suffix}")
                for n, sl in zip(names, self._slices()):
                    state_dict[n] = whole[sl]

    def projection_weights(self) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
        """The q, k, v projections as (weight, bias) views, whatever the layout."""
        if not self.fused:
            return {n[0]: (getattr(self, n).weight, getattr(self, n).bias) for n in _SPLIT}
        W, b = self.qkv_proj.weight, self.qkv_proj.bias
        return {
            n: (W[sl], None if b is None else b[sl]) for n, sl in zip("qkv", self._slices())
        }

    def head_state(self, heads: list[int], kv_heads: list[int]) -> dict[str, torch.Tensor]:
        """``state_dict()`` with only the rows of ``heads``/``kv_heads`` and ``out_proj``'s columns of ``heads``."""
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        device = self.out_proj.weight.device
        q_rows, kv_rows = head_rows(heads, D, device), head_rows(kv_heads, D, device)
        if self.fused:  # qkv_proj rows: [q heads (H*D) | k heads (G*D) | v heads (G*D)]
            rows = {"qkv_proj": torch.cat([q_rows, H * D + kv_rows, (H + G) * D + kv_rows])}
        else:
            rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        state = dict(self.state_dict())
        for name, idx in rows.items():
            for suffix in ("weight", "bias"):
                if f"{name}.{suffix}" in state:
                    state[f"{name}.{suffix}"] = state[f"{name}.{suffix}"][idx]
        state["out_proj.weight"] = state["out_proj.weight"][:, q_rows]  # (C, H*D) -> (C, H'*D)
        if "sinks" in state:
            state["sinks"] = state["sinks"][heads]  # (H,) -> (H',): each head's sink logit
        return state

    def subset_heads(self, heads: list[int], kv_heads: list[int]) -> MultiHeadAttention:
        """The same class and options with H' = len(heads), G' = len(kv_heads), D kept."""
        new = type(self)(
            self.embed_dim, len(heads), num_kv_heads=len(kv_heads), head_dim=self.head_dim,
            device="meta", dtype=self.out_proj.weight.dtype, **self.init_options,
        )  # fmt: skip
        return load_selected(new, self.head_state(heads, kv_heads), self)

    def project(
        self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project inputs to heads.

        Args:
            query: [B, T, C]; key: [B, S, kdim] or None (self-attention);
            value: [B, S, vdim] or None (same tensor as key).

        Returns:
            q [B, H, T, D], k [B, G, S, D], v [B, G, S, D].
        """
        H, G, D = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused:
            q, k, v = fused_qkv(self.qkv_proj, query, key, value, (H * D, G * D, G * D))
        else:
            key = query if key is None else key
            value = key if value is None else value
            q, k, v = self.q_proj(query), self.k_proj(key), self.v_proj(value)
        return split_heads(q, H), split_heads(k, G), split_heads(v, G)

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

        core = 2·B·H·P·(D + Dv) with P visible (query, key) pairs;
        projections = 2·B·(T·C·H·D + S·kdim·G·D + S·vdim·G·D + T·H·D·C).
        rope and qk_norm are elementwise and not counted; the qk_norm gains
        (2·D) are among the parameters.
        """
        S = T if S is None else S
        H, G, D, C = self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim
        pairs = visible_pairs(T, S, causal=causal, window=self.sliding_window)
        core = 2 * batch * H * pairs * (D + D)
        proj = 2 * batch * (T * C * H * D + S * self.kdim * G * D + S * self.vdim * G * D + T * H * D * C)
        params = sum(p.numel() for p in self.parameters())
        return AttentionCost(core, proj, params, 2 * G * D * bytes_per_element)


@register_attention("mha", MultiHeadAttention)
def _mha(*, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, **options) -> MultiHeadAttention:
    if num_kv_heads not in (None, num_heads):
        raise ValueError(f"'mha' has num_kv_heads == num_heads={num_heads}; got {num_kv_heads} (use 'gqa')")
    return MultiHeadAttention(embed_dim, num_heads, **options)


@register_attention("gqa", MultiHeadAttention)
def _gqa(*, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, **options) -> MultiHeadAttention:
    if num_kv_heads is None:
        raise ValueError("'gqa' needs num_kv_heads (a divisor of num_heads)")
    return MultiHeadAttention(embed_dim, num_heads, num_kv_heads=num_kv_heads, **options)


@register_attention("mqa", MultiHeadAttention)
def _mqa(*, embed_dim: int, num_heads: int, num_kv_heads: int | None = None, **options) -> MultiHeadAttention:
    if num_kv_heads not in (None, 1):
        raise ValueError(f"'mqa' has one key/value head; got num_kv_heads={num_kv_heads}")
    return MultiHeadAttention(embed_dim, num_heads, num_kv_heads=1, **options)
