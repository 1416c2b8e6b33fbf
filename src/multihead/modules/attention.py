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

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import dropout_probability, positive_int
from ..functional import attention, merge_masks
from .calls import check_call, default_alignment, rollback_on_error
from .cost import AttentionCost, visible_pairs
from .kv_cache import KVCache
from .observe import AttentionEvent, Observable
from .rotary_qk import RotaryQK

if TYPE_CHECKING:
    from .torch_compat import TorchMultiheadAttention

__all__ = ["MultiHeadAttention", "check_heads"]

_SPLIT = ("q_proj", "k_proj", "v_proj")
_NORMS = ("q_norm", "k_norm")


def check_heads(
    embed_dim: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None
) -> tuple[int, int, int]:
    """Validate head sizes; return (num_heads, num_kv_heads, head_dim).

    Raises:
        TypeError: a size that is not an int.
        ValueError: non-positive sizes, embed_dim not divisible by num_heads
            (when head_dim is not given), num_kv_heads not dividing num_heads.
    """
    positive_int("embed_dim", embed_dim)
    positive_int("num_heads", num_heads)
    if head_dim is None:
        if embed_dim % num_heads != 0:
            raise ValueError(
                f"embed_dim={embed_dim} is not divisible by num_heads={num_heads}; "
                "pass head_dim explicitly to decouple them"
            )
        head_dim = embed_dim // num_heads
    positive_int("head_dim", head_dim)
    G = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    if G > num_heads or num_heads % G != 0:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={num_heads}")
    return num_heads, G, head_dim


class MultiHeadAttention(RotaryQK, Observable, nn.Module):
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

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        kdim: int | None = None,
        vdim: int | None = None,
        qkv_bias: bool = True,
        out_bias: bool = True,
        dropout: float = 0.0,
        rope: bool | dict = False,
        qk_norm: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        H, G, D = check_heads(embed_dim, num_heads, num_kv_heads, head_dim)
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, H, G, D
        if type(self).kind == MultiHeadAttention.kind:  # the family's per-instance name
            self.kind = "mha" if G == H else "mqa" if G == 1 else "gqa"
        self.kdim = embed_dim if kdim is None else positive_int("kdim", kdim)
        self.vdim = embed_dim if vdim is None else positive_int("vdim", vdim)
        self.dropout = dropout_probability(dropout)
        factory = {"device": device, "dtype": dtype}
        self.fused = self.kdim == embed_dim and self.vdim == embed_dim
        if self.fused:
            self.qkv_proj = nn.Linear(embed_dim, (H + 2 * G) * D, bias=qkv_bias, **factory)
        else:
            self.q_proj = nn.Linear(embed_dim, H * D, bias=qkv_bias, **factory)
            self.k_proj = nn.Linear(self.kdim, G * D, bias=qkv_bias, **factory)
            self.v_proj = nn.Linear(self.vdim, G * D, bias=qkv_bias, **factory)
        self.out_proj = nn.Linear(H * D, embed_dim, bias=out_bias, **factory)
        self.init_rotary_qk(rope, qk_norm, D, **factory)
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
        B, T, _ = query.shape
        if key is None and self.fused:
            qkv = self.qkv_proj(query)  # (B, T, (H + 2G) * D)
            q, k, v = qkv.split([H * D, G * D, G * D], dim=-1)
        else:
            w = self.projection_weights()
            key = query if key is None else key
            value = key if value is None else value
            q = F.linear(query, *w["q"])
            if value is key and self.fused:
                W, b = self.qkv_proj.weight, self.qkv_proj.bias
                kv_rows = slice(H * D, (H + 2 * G) * D)
                k, v = F.linear(key, W[kv_rows], None if b is None else b[kv_rows]).split(G * D, dim=-1)
            else:
                k, v = F.linear(key, *w["k"]), F.linear(value, *w["v"])
        S = k.shape[1]
        q = q.view(B, T, H, D).transpose(1, 2)  # (B, T, H*D) -> (B, H, T, D)
        k = k.view(B, S, G, D).transpose(1, 2)  # (B, S, G*D) -> (B, G, S, D)
        v = v.view(B, S, G, D).transpose(1, 2)  # (B, S, G*D) -> (B, G, S, D)
        return q, k, v

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H, T, D] head outputs -> [B, T, C] through ``out_proj``."""
        B, H, T, D = out.shape
        out = out.transpose(1, 2).reshape(B, T, H * D)  # (B, H, T, D) -> (B, T, H*D)
        return self.out_proj(out)

    def make_kv_cache(
        self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None
    ) -> KVCache:
        """A cache sized for this layer: (batch_size, G, max_len, D)."""
        ref = self.out_proj.weight
        return KVCache(
            batch_size,
            self.num_kv_heads,
            max_len,
            self.head_dim,
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

        Args:
            query: [B, T, C].
            key: [B, S, kdim], or None for self-attention.
            value: [B, S, vdim], or None to use ``key``.
            attn_mask: bool (True = may attend) or float (added), shaped
                (T, S) or 4-D broadcastable to (B, H, T, S).
            key_padding_mask: [B, S], bool with True = real key (may attend),
                the polarity of Hugging Face's attention_mask and the
                opposite of ``torch.nn.MultiheadAttention`` (use
                ``functional.padding_mask_from_ignore`` to convert), or float
                (added). Combined with ``attn_mask`` by AND on "may attend".
            is_causal: hide future keys.
            causal_alignment: "top_left" or "bottom_right"; defaults to
                "bottom_right" with a KV cache and "top_left" otherwise.
            return_weights: also return the exact weights [B, H, T, S].
                While an observer is registered (``register_attention_observer``)
                the weights are computed on every call and passed to it.
            kv_cache: append this call's keys/values to the cache and attend
                over everything cached (self-attention only). S is then the
                cache length after the write.
            backend: passed to ``functional.attention``.
            positions: rope positions of the T queries, [T] or [B, T]
                (integer or floating), e.g. ``cumsum(mask) - 1`` for a
                left-padded batch; in self-attention (and with a cache)
                also the positions of the new keys. Default: 0 .. T-1,
                offset by the cache length before this call's write. In
                cross-attention the keys are at 0 .. S-1. Only valid with
                ``rope``.

        Returns:
            out [B, T, C], or (out, weights [B, H, T, S]).

        Raises:
            ValueError / TypeError: shapes, widths, masks, cache overflow
                (before anything is written).
        """
        check_call(query, key, value, kv_cache, embed_dim=self.embed_dim, kdim=self.kdim, vdim=self.vdim)
        B = query.shape[0]
        q, k, v = self.project(query, key, value)
        q, k = self.rotate_call(q, k, query=query, key=key, kv_cache=kv_cache, positions=positions)
        causal_alignment = default_alignment(causal_alignment, kv_cache)
        observed = self.observed
        with rollback_on_error(kv_cache):
            if kv_cache is not None:
                k, v = kv_cache.update(k, v)
            S = k.shape[2]
            mask = merge_masks(attn_mask, self._padding(key_padding_mask, B, S))
            out = attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=is_causal,
                causal_alignment=causal_alignment,
                dropout_p=self.dropout,
                training=self.training,
                return_weights=return_weights or observed,
                backend=backend,
            )
        weights = None
        if return_weights or observed:
            out, weights = out
        if observed:
            self.notify_observers(weights, q, k, mask, is_causal=is_causal, causal_alignment=causal_alignment)
        out = self.merge_heads(out)
        return (out, weights) if return_weights else out

    def notify_observers(
        self,
        weights: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        mask: torch.Tensor | None,
        *,
        is_causal: bool,
        causal_alignment: str,
    ) -> None:
        """Hand one call's weights [B, H, T, S] and projected q/k to the observers."""
        self._notify(
            AttentionEvent(
                weights=weights.detach(),
                q=q.detach(),
                k=k.detach(),
                scale=self.head_dim**-0.5,
                attn_mask=mask,
                is_causal=is_causal,
                causal_alignment=causal_alignment,
                kind=self.kind,
            )
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

        core = 2·B·H·P·(D + Dv) with P visible (query, key) pairs;
        projections = 2·B·(T·C·H·D + S·kdim·G·D + S·vdim·G·D + T·H·D·C).
        rope and qk_norm are elementwise and not counted; the qk_norm gains
        (2·D) are among the parameters.
        """
        S = T if S is None else S
        H, G, D, C = self.num_heads, self.num_kv_heads, self.head_dim, self.embed_dim
        pairs = visible_pairs(T, S, causal=causal)
        core = 2 * batch * H * pairs * (D + D)
        proj = 2 * batch * (T * C * H * D + S * self.kdim * G * D + S * self.vdim * G * D + T * H * D * C)
        params = sum(p.numel() for p in self.parameters())
        return AttentionCost(core, proj, params, 2 * G * D * bytes_per_element)

    def aux_loss(self) -> torch.Tensor:
        """The training loss term of the last forward: a 0-d zero (no such term),
        on the device and dtype of ``out_proj.weight``."""
        w = self.out_proj.weight
        return torch.zeros((), device=w.device, dtype=w.dtype)

    @staticmethod
    def _padding(mask: torch.Tensor | None, B: int, S: int) -> torch.Tensor | None:
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"key_padding_mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
            raise TypeError(f"key_padding_mask must be bool or floating, got dtype {mask.dtype}")
        if tuple(mask.shape) != (B, S):
            raise ValueError(f"key_padding_mask must be (B, S) = ({B}, {S}), got {tuple(mask.shape)}")
        return mask[:, None, None, :]  # (B, S) -> (B, 1, 1, S)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> TorchMultiheadAttention:
        """Convert a ``torch.nn.MultiheadAttention`` into a drop-in equivalent.

        Returns a :class:`TorchMultiheadAttention`: it takes the torch
        module's inputs (its ``batch_first`` layout, its mask polarity, its
        ``need_weights``/``average_attn_weights``) and returns what the torch
        module returns, computed by a ``MultiHeadAttention`` (``.attention``)
        holding copies of the weights.
        """
        from .torch_compat import TorchMultiheadAttention

        return TorchMultiheadAttention.from_torch(module)

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        parts.append(f"head_dim={self.head_dim}")
        if not self.fused:
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.rope is not None:
            parts.append(f"rope={self.rope}")
        return ", ".join(parts)
