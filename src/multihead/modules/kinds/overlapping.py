"""Multi-overlapped-head self-attention (MOHSA): heads that share channels.

Zhang, Luo and Wang, "Improving Vision Transformers by Overlapping Heads in
Multi-Head Self-Attention", arXiv:2410.14874 (2024); official code
``ZTX-100/MOHSA``. Registry name ``"overlapping"``.

Each projected q, k, v row (width H·D) is zero-padded by ``overlap`` (ov)
channels at both ends; head i reads padded channels [i·D, (i+1)·D + 2·ov),
i.e. original channels [i·D - ov, (i+1)·D + ov)::

    H = 3, D = 2, ov = 1           padded row:  0 | c0 c1 | c2 c3 | c4 c5 | 0
    head 0 = [0  c0 c1 c2]    head 1 = [c1 c2 c3 c4]    head 2 = [c3 c4 c5 0]

The heads are a strided view of the padded row (``unfold`` with size D + 2·ov
and step D: nothing is copied, no loop over heads), so the fused
``functional.attention`` runs on heads of width Dw = D + 2·ov with the scale
kept at D^(-1/2) as in the paper. Head outputs (Dw wide) are concatenated
head-major and ``out_proj`` maps H·Dw back to C. ``overlap=0`` is
``MultiHeadAttention`` with the same weights (same parameter names).

    x (B, T, C) --qkv_proj--> (B, T, H*D) each --pad--> (B, T, H*D + 2ov)
      --unfold--> (B, H, T, Dw) --attention--> (B, H, T, Dw)
      --merge--> (B, T, H*Dw) --out_proj--> (B, T, C)

Options ``rope`` and ``qk_norm`` act on the widened heads q̃_i, k̃_i of width
Dw (after ``unfold``, before attention): qk_norm RMS-normalises each widened
head over its Dw channels (the zero padding of the edge heads included) with
gains of size Dw, then rope rotates the Dw channels (Dw must be even, or
pass an even ``rotary_dim``). Values are untouched. The rotated widened keys
of neighbouring heads no longer share channels, so with either option on
the KV cache stores the widened keys and values per head, (B, H, S_max, Dw)
each, instead of the shared padded rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..._checks import non_negative_int
from ..base import AttentionLayer
from ..cost import AttentionCost, visible_pairs
from ..kv_cache import KVCache
from ..projections import fused_qkv
from ..registry import register_attention

__all__ = ["OverlappingHeadAttention", "overlapped_heads"]


def overlapped_heads(padded: torch.Tensor, num_heads: int, head_dim: int, overlap: int) -> torch.Tensor:
    """View zero-padded channels as overlapping heads (no copy).

    Args:
        padded: [B, N, H·D + 2·ov], the projection padded by ov zeros at each end.
        num_heads: H. head_dim: D. overlap: ov.

    Returns:
        [B, H, N, D + 2·ov], a view of ``padded``: head i is padded channels
        [i·D, (i+1)·D + 2·ov).
    """
    width = num_heads * head_dim + 2 * overlap
    if padded.shape[-1] != width:
        raise ValueError(
            f"padded has {padded.shape[-1]} channels; num_heads={num_heads} heads of head_dim={head_dim} "
            f"with overlap={overlap} need H·D + 2·ov = {width}"
        )
    heads = padded.unfold(-1, head_dim + 2 * overlap, head_dim)  # (B, N, H*D + 2ov) -> (B, N, H, Dw)
    return heads.transpose(1, 2)  # (B, N, H, Dw) -> (B, H, N, Dw)


class OverlappingHeadAttention(AttentionLayer):
    """Attention whose heads overlap their neighbours by ``overlap`` channels.

    Args:
        embed_dim: C, the model width of queries, keys, values and outputs.
        num_heads: H.
        overlap: ov >= 0 channels each head takes from each neighbour (the
            paper sets it to the layer index; 0 is plain MHA). ov may exceed D,
            in which case a head reaches past its immediate neighbours.
        head_dim: D, the un-widened head width (default C // H).
        qkv_bias, out_bias: biases of the input and output projections.
        dropout: dropout on the attention weights in training mode.
        num_kv_heads: only None or H (grouped key/value heads are not part of
            this variant).
        rope: rotary position embeddings on the widened heads q̃, k̃ (all
            Dw = D + 2·ov channels): False (off), True (base 10000,
            rotate-half pairing, all Dw channels) or a dict of ``apply_rope``
            options ``base``, ``interleaved``, ``rotary_dim`` (even, <= Dw;
            required when Dw is odd, i.e. when D is odd). Positions are
            0 .. T-1, offset by the cache length when decoding, or the
            ``positions`` argument of ``forward``.
        qk_norm: RMS-normalise each widened query and key head over its Dw
            channels (edge heads' zero padding included) with learned gains
            ``qk_norm.q_norm.weight`` and ``qk_norm.k_norm.weight`` [Dw].
        device, dtype: of the parameters.

    Parameters: ``qkv_proj`` (3·H·D, C) with rows [q | k | v], and
    ``out_proj`` (C, H·(D + 2·ov)); with ``qk_norm`` also the two [Dw] gains.

    Order inside forward: project -> pad -> overlapping heads (Dw wide) ->
    qk_norm -> rope -> attention. The forward is ``AttentionLayer.forward``
    (arguments, masks and cache as :class:`MultiHeadAttention`, keys and
    values of width C). ``return_weights`` gives, per head, the
    probabilities softmax(q̃_i k̃_iᵀ · D^(-1/2)) that mix the widened values;
    observers receive them with the widened q̃ [B, H, T, Dw], k̃ [B, H, S, Dw]
    (after qk_norm and rope) and scale D^(-1/2).

    Raises:
        ValueError: invalid sizes, overlap, dropout, num_kv_heads or rope
            options, e.g. rope=True with an odd Dw (the message names the
            values).
        TypeError: a size or overlap that is not an int.
    """

    kind = "overlapping"
    refused_options = ("kdim", "vdim")  # one fused projection of the model width
    head_independence = (
        "neighbouring heads share projection channels (head i reads channels [i*D - overlap, (i+1)*D + overlap)), "
        "so no head owns its rows of the projections"
    )

    @classmethod
    def comparison_options(cls, kind: str, num_heads: int) -> dict:
        """One shared channel on each side of a head (``overlap=1``), the smallest overlap."""
        return {"overlap": 1}

    def __init__(self, embed_dim: int, num_heads: int, *, overlap: int = 0, num_kv_heads: int | None = None,
                 **options) -> None:  # fmt: skip
        super().__init__(embed_dim, num_heads, **options)
        H, D = self.num_heads, self.head_dim
        if num_kv_heads is not None and num_kv_heads != H:
            raise ValueError(
                f"'overlapping' has no grouped key/value heads: num_kv_heads={num_kv_heads} "
                f"must be None or num_heads={H}"
            )
        self.overlap = non_negative_int("overlap", overlap)
        self.scale = D**-0.5  # the paper keeps the un-widened scale
        self.qkv_proj = nn.Linear(embed_dim, 3 * H * D, bias=self.qkv_bias, **self.factory)
        Dw = self.wide_head_dim
        self.init_output(H * Dw, embed_dim)
        rope = options.get("rope", False)
        if (rope is True or (isinstance(rope, dict) and rope.get("rotary_dim") is None)) and Dw % 2:
            raise ValueError(
                f"rope rotates the widened heads of width Dw = D + 2*overlap = {D} + 2*{self.overlap} = {Dw}, "
                f"which is odd; pass rope={{'rotary_dim': <even int <= {Dw}>}}"
            )
        self.init_positions(Dw)

    @property
    def _per_head_cache(self) -> bool:
        """Whether the KV cache holds widened per-head rows (rope or qk_norm on)."""
        return self.rope is not None or self.qk_norm is not None

    @property
    def wide_head_dim(self) -> int:
        """Dw = D + 2·overlap, the width every head attends with."""
        return self.head_dim + 2 * self.overlap

    # ------------------------------------------------------------------ pieces
    def project(
        self, query: torch.Tensor, key: torch.Tensor | None = None, value: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and zero-pad: q [B, T, H·D + 2ov], k and v [B, S, H·D + 2ov]."""
        HD = self.num_heads * self.head_dim
        q, k, v = fused_qkv(self.qkv_proj, query, key, value, (HD, HD, HD))
        ov = self.overlap
        if ov:
            q, k, v = (F.pad(t, (ov, ov)) for t in (q, k, v))  # (B, N, H*D) -> (B, N, H*D + 2ov)
        return q, k, v

    def heads(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, N, H·D + 2ov] padded projection -> [B, H, N, Dw] overlapping heads (a view)."""
        return overlapped_heads(padded, self.num_heads, self.head_dim, self.overlap)

    def to_heads(self, query, key=None, value=None):
        """Overlapping heads q, k, v [B, H, N, Dw] (views of the padded rows); with
        the row cache (rope and qk_norm off) ``extra["rows"]`` = the padded key
        and value rows [B, S, H·D + 2ov] the cache stores."""
        q, k, v = self.project(query, key, value)
        extra = None if self._per_head_cache else {"rows": (k, v)}
        return self.heads(q), self.heads(k), self.heads(v), extra  # (B, N, H*D + 2ov) -> (B, H, N, Dw)

    def write_cache(self, cache: KVCache, k, v, extra):
        """Per-head rows with rope/qk_norm on; otherwise the padded rows, read
        back as overlapping heads."""
        if extra is None:
            return super().write_cache(cache, k, v, extra)
        k_rows, v_rows = extra["rows"]
        k_rows, v_rows = cache.update(k_rows.unsqueeze(1), v_rows.unsqueeze(1))  # (B, T, W) -> (B, 1, T, W)
        return self.heads(k_rows.squeeze(1)), self.heads(v_rows.squeeze(1)), extra  # (B, 1, S, W) -> (B, H, S, Dw)

    def make_kv_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None
    ) -> KVCache:
        """A cache of padded key/value rows: (batch_size, 1, max_len, H·D + 2·ov).

        The cache stores each token's zero-padded projection once; the
        overlapping heads are strided views into it, so the shared channels
        are not stored twice. With ``rope`` or ``qk_norm`` on, the cache
        holds the normalised/rotated widened keys and the widened values per
        head instead: (batch_size, H, max_len, Dw) each.
        """
        ref = self.out_proj.weight
        if self._per_head_cache:
            return KVCache(
                batch_size,
                self.num_heads,
                max_len,
                self.wide_head_dim,
                dtype=dtype or ref.dtype,
                device=device or ref.device,
            )
        return KVCache(
            batch_size,
            1,
            max_len,
            self.num_heads * self.head_dim + 2 * self.overlap,
            dtype=dtype or ref.dtype,
            device=device or ref.device,
        )

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

        With Dw = D + 2·ov and P visible (query, key) pairs:
        core = 2·B·H·P·(Dw + Dw) (scores and value mixing over widened heads);
        projections = 2·B·(T·C·H·D + 2·S·C·H·D + T·H·Dw·C) (the output
        projection is the wider one; padding is free);
        kv_cache_bytes_per_token = 2·(H·D + 2·ov)·bytes_per_element (one
        padded key row and one padded value row), or 2·H·Dw·bytes_per_element
        with rope or qk_norm on (per-head widened rows). rope and qk_norm are
        elementwise and not counted; the qk_norm gains (2·Dw) are among the
        parameters.
        """
        S = T if S is None else S
        H, D, C, Dw = self.num_heads, self.head_dim, self.embed_dim, self.wide_head_dim
        pairs = visible_pairs(T, S, causal=causal, window=self.sliding_window)
        core = 2 * batch * H * pairs * (Dw + Dw)
        proj = 2 * batch * (T * C * H * D + 2 * S * C * H * D + T * H * Dw * C)
        params = sum(p.numel() for p in self.parameters())
        row = H * Dw if self._per_head_cache else H * D + 2 * self.overlap
        return AttentionCost(core, proj, params, 2 * row * bytes_per_element)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, overlap={self.overlap}"

@register_attention("overlapping", OverlappingHeadAttention)
def _overlapping(*, embed_dim: int, num_heads: int, **options) -> OverlappingHeadAttention:
    return OverlappingHeadAttention(embed_dim, num_heads, **options)
