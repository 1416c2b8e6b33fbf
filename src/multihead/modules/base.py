"""The attention layer every kind is built on: one forward, hooks for what differs.

    forward(query [B, T, C], key [B, S, kdim] | None, value | None)
      check_call                          shapes, widths, dtypes, cache use
      q, k, v, extra = to_heads(...)      [kind] project, plus per-call extras
      q, k = position_qk(q, k, ...)       qk_norm -> rope (self.qk_norm, self.rope); after the
                                          write for a streaming cache of positions="cache"
      with rollback_on_error(kv_cache):   a failing call leaves the cache as it was
          k, v, extra = write_cache(...)  [kind layout] append, read everything cached
          mask = attn_mask AND key_mask
          out, weights = core(...)        [kind] default: functional.attention
      observers <- AttentionEvent(weights, q, k, v, mask, heads, rows, ...)
      out = head hooks(out)               only while one is registered
      return merge_heads(out)             (B, H, T, Dv) -> (B, T, H*Dv) -> out_proj

A kind subclasses :class:`AttentionLayer` and supplies (``project`` and
``cost`` are abstract: a class without them cannot be built):

* ``project(query, key, value) -> (q, k, v)``: q [B, H, T, D],
  k [B, G, S, D], v [B, G, S, Dv]; and ``to_heads`` when a call needs more
  than that (a dict of extras its core or cache reads: routing gates,
  dynamic weights);
* ``core(q, k, v, extra, ...)`` when it is not ``functional.attention``;
* ``make_kv_cache`` / ``write_cache`` when its cache layout is its own;
* ``cost()``, and ``aux_loss()`` when it has a training loss term.

``__init__`` calls ``super().__init__`` (sizes, dropout, observers), creates
its projections, then ``init_output`` (``out_proj``) and ``init_positions``
(``rope``/``qk_norm``). ``docs/adding-a-kind.md`` walks through a new kind.

Cross-attention with a cache: ``kv_cache`` given together with ``key``
holds the keys/values of that ``key`` tensor (an encoder's memory). The
first call projects them and fills the cache; later calls with the same key
tensor read them back and project only the queries (``key[:, :0]``, zero
keys, goes through ``project``). Cross-attention keys sit at rope positions
0 .. S-1, and the queries at 0 .. T-1 unless ``positions`` says otherwise.
"""

from __future__ import annotations

from abc import ABCMeta, abstractmethod

import torch
from torch import nn

from .._checks import dropout_probability, positive_int
from ..functional import attention, merge_masks
from ..functional.masks import check_alignment
from .calls import (
    check_cache_use,
    check_call,
    check_forward_options,
    default_alignment,
    key_padding,
    refuse_torch_padding,
    rollback_on_error,
)
from .head_selection import check_heads
from .hooked_layer import HookedLayer
from .kind_capabilities import KindCapabilities
from .kv_cache import KVCache
from .local import check_window, kept_key_columns, local_mask, make_sinks
from .norms import QKNorm
from .observe import notify, observed_selection
from .rope import Rotary, query_positions
from .score_options import init_score_options, refuse_options
from .weight_only import layer_dtype_device

__all__ = ["AttentionLayer"]


class AttentionLayer(KindCapabilities, HookedLayer, metaclass=ABCMeta):
    """Base of every attention kind: sizes, observers, cache handling and THE forward.

    Args:
        embed_dim: C, the width of queries (and outputs unless the kind says).
        num_heads: H query heads.
        num_kv_heads: G key/value heads (None: H).
        head_dim: D (default C // H).
        kdim, vdim: widths of key and value inputs (default C).
        qkv_bias, out_bias: biases of the input projections (``qkv_bias``,
            read by the kind's own projections) and of ``out_proj``.
        dropout: on the attention weights in training mode.
        rope, qk_norm, alibi, softcap: rotary embeddings, per-head RMS norm of q and k
            (``init_positions``), ALiBi and soft-capping (``score_options``); all off by default.
        sinks: a learned sink logit per query head, ``self.sinks`` [H]
            (``modules.local``; kinds whose core is not ``functional.attention``
            refuse it).
        window: None, or w: query i sees keys j with i - w < j <= i
            (``modules.local``), through the mask.
        device, dtype: of the parameters (``self.factory``).

    These are the options every kind shares, written once: a kind's
    constructor lists only its own and passes ``**options`` on. A kind that
    cannot use one names it in ``refused_options``; a value for it is a
    TypeError. ``init_options`` holds the shared options as given (and a
    kind adds its own), so ``subset_heads`` can build the same layer again.

    What a kind declares on its class (its registry name, the options and backends it
    takes, its capabilities) and the head selection built on it: ``KindCapabilities``
    (``modules.kind_capabilities``).

    Attributes:
        rope: a ``Rotary`` or None; qk_norm: a ``QKNorm`` or None.
        scale: the score multiplier (None: 1/sqrt of the query width, the
            default of ``functional.attention``).
        out_proj: the output projection (``init_output``).

    Observers (``register_attention_observer``) and head hooks
    (``register_head_hook``, ``fn(layer, out)`` on the head outputs [B, H, T, Dv]
    before ``merge_heads``) come from ``HookedLayer`` (``modules.hooked_layer``).
    """

    selects_weights = True  # its default core passes a WeightSelection to functional.attention

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
        alibi: bool | list = False, softcap: float | None = None,
        sinks: bool = False,
        window: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        refuse_options(self, {"num_kv_heads": num_kv_heads, "kdim": kdim, "vdim": vdim, "alibi": alibi or None,
                              "softcap": softcap, "sinks": sinks or None, "window": window})  # fmt: skip
        H, G, D = check_heads(embed_dim, num_heads, num_kv_heads, head_dim)
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, H, G, D
        self.kdim = embed_dim if kdim is None else positive_int("kdim", kdim)
        self.vdim = embed_dim if vdim is None else positive_int("vdim", vdim)
        self.dropout = dropout_probability(dropout)
        self.qkv_bias, self.out_bias = qkv_bias, out_bias
        self.factory = {"device": device, "dtype": dtype}
        self._positions = (rope, qk_norm)
        self.init_options = {n: v for n, v in (("kdim", self.kdim), ("vdim", self.vdim)) if n not in self.refused_options}
        self.init_options.update(qkv_bias=qkv_bias, out_bias=out_bias, dropout=dropout, rope=rope, qk_norm=qk_norm)
        init_score_options(self, alibi, softcap)  # alibi_slopes [H] buffer or None, softcap
        self.sliding_window = check_window(window)
        self.sinks = make_sinks(sinks, H, self.factory)
        self.init_options.update({n: v for n, v in (("sinks", sinks), ("window", window)) if v})
        self.scale: float | None = None
        self.rope: Rotary | None = None
        self.qk_norm: QKNorm | None = None

    # ------------------------------------------------------------------ building
    def init_output(self, in_features: int, out_features: int) -> None:
        """Create ``out_proj`` [out_features, in_features] (the merged heads -> output),
        with ``out_bias`` and the layer's device and dtype."""
        self.out_proj = nn.Linear(in_features, out_features, bias=self.out_bias, **self.factory)

    def init_positions(self, dim: int) -> None:
        """Create ``self.rope`` (``Rotary``) and ``self.qk_norm`` (``QKNorm`` over
        ``dim`` channels) from the ``rope`` and ``qk_norm`` options, each None when off.

        Raises:
            TypeError / ValueError: a non-bool ``qk_norm`` or invalid rope options.
        """
        rope, qk_norm = self._positions
        self.rope = Rotary.from_option(rope, dim)
        if not isinstance(qk_norm, bool):
            raise TypeError(f"qk_norm must be a bool, got qk_norm={qk_norm!r}")
        self.qk_norm = QKNorm(dim, **self.factory) if qk_norm else None

    # ------------------------------------------------------------------ observers
    def notify_observers(self, weights, q, k, mask, *, is_causal: bool, causal_alignment: str, heads=None, rows=None,
                         v=None):  # fmt: skip
        """Hand one call's weights [B, h, r, S] of query heads ``heads`` and rows ``rows``
        (None: all H, T) and its q/k/v to each observer, cut to its own part."""
        notify(self, list(self._attention_observers.values()), weights, (heads, rows), self.num_heads, q=q, k=k, v=v,
               attn_mask=mask, scale=q.shape[-1] ** -0.5 if self.scale is None else self.scale, is_causal=is_causal,
               causal_alignment=causal_alignment, kind=self.kind)  # fmt: skip

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def project(self, query, key=None, value=None):
        """[kind] q [B, H, T, D], k [B, G, S, D], v [B, G, S, Dv] from the inputs
        (S may be 0: a cross-attention call that reuses cached keys)."""

    @abstractmethod
    def cost(self, T: int, S: int | None = None, *, batch: int = 1, causal: bool = False, bytes_per_element: int = 2):
        """[kind] ``modules.cost.AttentionCost`` of one call (T queries, S keys)."""

    def to_heads(self, query, key=None, value=None):
        """(q, k, v, extra) for one call: ``project`` and the kind's per-call
        extras (a dict its core or cache reads, or None)."""
        q, k, v = self.project(query, key, value)
        return q, k, v, None

    def position_qk(self, q: torch.Tensor, k: torch.Tensor, q_pos, k_pos) -> tuple[torch.Tensor, torch.Tensor]:
        """qk_norm, then rope at the queries' and keys' positions (each only if on)."""
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)
        if self.rope is not None:
            q, k = self.rope(q, q_pos), self.rope(k, k_pos)
        return q, k

    def write_cache(self, cache: KVCache, k, v, extra):
        """Append this call's keys/values; return everything cached (and the extras)."""
        k, v = cache.update(k, v)
        return k, v, extra

    def core(self, q, k, v, extra, *, attn_mask, is_causal, causal_alignment, return_weights, backend):
        """[kind] (out [B, H, T, Dv], weights [B, H, T, S] or None); default ``functional.attention``."""
        out = attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, causal_alignment=causal_alignment,
            scale=self.scale, dropout_p=self.dropout, training=self.training,
            return_weights=return_weights, backend=backend, alibi_slopes=self.alibi_slopes, softcap=self.softcap,
            sinks=self.sinks,
        )  # fmt: skip
        return out if return_weights else (out, None)

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H, T, Dv] head outputs -> [B, T, out] through ``out_proj``."""
        B, H, T, Dv = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(B, T, H * Dv))  # (B, H, T, Dv) -> (B, T, H*Dv)

    def make_kv_cache(self, batch_size: int, max_len: int, *, dtype: torch.dtype | None = None, device=None):
        """A cache sized for this layer: keys and values (batch_size, G, max_len, D)."""
        ref_dtype, ref_device = layer_dtype_device(self.out_proj)  # also of weight-only (bf16/int8) projections
        return KVCache(batch_size, self.num_kv_heads, max_len, self.head_dim,
                       dtype=dtype or ref_dtype, device=device or ref_device)  # fmt: skip

    def aux_loss(self) -> torch.Tensor:
        """The training loss term of the last forward: a 0-d zero for kinds without
        one, on the device and dtype of ``out_proj.weight``."""
        w = self.out_proj.weight
        return torch.zeros((), device=w.device, dtype=w.dtype)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        *,
        attn_mask: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        causal_alignment: str | None = None,
        return_weights: bool = False,
        kv_cache: KVCache | None = None,
        backend: str = "auto",
        positions: torch.Tensor | None = None,
        **options,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from ``query`` to ``key``/``value`` (self-attention when None).

        Args:
            query: [B, T, C].
            key: [B, S, kdim], or None for self-attention.
            value: [B, S, vdim], or None to use ``key``.
            attn_mask: bool (True = may attend) or float (added), shaped
                (T, S) or 4-D broadcastable to (B, H, T, S).
            key_mask: [B, S], bool with True = may attend (a real key: the
                polarity of SDPA's ``attn_mask`` and Hugging Face's
                ``attention_mask``) or float (added). Combined with
                ``attn_mask`` by AND on "may attend". torch's
                ``key_padding_mask`` (True = ignore) is refused with a
                TypeError: pass ``key_mask=~key_padding_mask``.
            is_causal: hide future keys.
            causal_alignment: "top_left" or "bottom_right"; defaults to
                "bottom_right" with a self-attention cache, else "top_left".
            return_weights: also return the weights that mix the values
                [B, H, T, S] (each kind's docstring says what they are).
            kv_cache: from :meth:`make_kv_cache`. Self-attention: append this
                call's keys/values and attend over everything cached.
                Cross-attention (``key`` given): the cache holds the keys of
                ``key``; the first call fills it, later calls with the same
                key tensor reuse it (see the module docstring).
            backend: passed to the core (``functional.attention``).
            positions: rope positions of the T queries, [T] or [B, T]; in
                self-attention also of the new keys. Default 0 .. T-1,
                offset by the cache length before this call's write;
                cross-attention keys are at 0 .. S-1. Only valid with rope,
                and not with a streaming cache of ``positions="cache"``,
                which places the queries and keys at their cache slots.
            options: the kind's ``forward_options`` (passed to its core).

        Returns:
            out [B, T, out], or (out, weights).

        Raises:
            TypeError: a query of another dtype than the layer's parameters
                (outside ``torch.autocast``), naming both dtypes.
            ValueError / TypeError: shapes, widths, masks, backend, options,
                cache overflow or a cache of other keys (before anything is
                written; a call that fails leaves the cache as it was).
        """
        check_call(query, key, value, kv_cache, embed_dim=self.embed_dim, kdim=self.kdim, vdim=self.vdim,
                   dtype=layer_dtype_device(self.out_proj)[0])  # fmt: skip
        refuse_torch_padding(options)
        if options or self.backends is not None:
            check_forward_options(self, backend, options)
        if causal_alignment is not None:
            check_alignment(causal_alignment)
        cross = key is not None
        causal_alignment = default_alignment(causal_alignment, None if cross else kv_cache)
        if kv_cache is not None and check_cache_use(kv_cache, key):
            key, value = key[:, :0], None if value is None else value[:, :0]  # cached: project no keys
        q, k, v, extra = self.to_heads(query, key, value)
        slots = not cross and getattr(kv_cache, "positions", None) == "cache"  # streaming_cache: rope by cache slot
        if slots and positions is not None:
            raise ValueError("positions cannot be given with a streaming cache of positions='cache': "
                             "the cache places the queries and keys at their slots")  # fmt: skip
        if not slots:
            q_pos = k_pos = None
            if self.rope is not None or positions is not None:
                offset = 0 if kv_cache is None or cross else kv_cache.length
                q_pos = query_positions(
                    positions, rope=self.rope, B=query.shape[0], T=query.shape[1], offset=offset, device=query.device
                )
                k_pos = None if cross else q_pos  # cross-attention keys at 0 .. S-1
            q, k = self.position_qk(q, k, q_pos, k_pos)
        observed, ask, got = self.observed, return_weights, (None, None)
        if observed and not return_weights:  # observers only: the union of their heads and rows
            ask = observed_selection(self._attention_observers.values(), self.num_heads, q.shape[2])[0]
            ask, got = (ask, (ask.heads, ask.rows)) if self.selects_weights else (True, got)
        with rollback_on_error(kv_cache):
            if kv_cache is not None:
                k, v, extra = self.write_cache(kv_cache, k, v, extra)
            if slots:  # the kept keys at 0 .. m - 1, the queries at the slots of their own keys
                k_pos = torch.arange(k.shape[2], device=q.device)
                q, k = self.position_qk(q, k, k_pos[k.shape[2] - q.shape[2] :], k_pos)
            attn_mask, key_mask = (kept_key_columns(m, kv_cache, k.shape[2]) for m in (attn_mask, key_mask))
            mask = merge_masks(attn_mask, key_padding(key_mask, query.shape[0], k.shape[2]))
            mask = merge_masks(mask, local_mask(self.sliding_window, kv_cache, q.shape[2], k.shape[2], causal_alignment,
                                                cross, q.device))  # fmt: skip
            out, weights = self.core(
                q, k, v, extra, attn_mask=mask, is_causal=is_causal, causal_alignment=causal_alignment,
                return_weights=ask, backend=backend, **options,
            )  # fmt: skip
        if observed:
            self.notify_observers(weights, q, k, mask, is_causal=is_causal, causal_alignment=causal_alignment,
                                  heads=got[0], rows=got[1], v=v)  # fmt: skip
        if self._head_hooks:
            out = self.run_head_hooks(out)
        out = self.merge_heads(out)
        return (out, weights) if return_weights else out

    def extra_repr(self) -> str:
        parts = [f"embed_dim={self.embed_dim}", f"num_heads={self.num_heads}"]
        if self.num_kv_heads != self.num_heads:
            parts.append(f"num_kv_heads={self.num_kv_heads}")
        parts.append(f"head_dim={self.head_dim}")
        if (self.kdim, self.vdim) != (self.embed_dim, self.embed_dim):
            parts.append(f"kdim={self.kdim}, vdim={self.vdim}")
        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        parts += [f"{n}={v}" for n, v in (("sinks", self.sinks is not None), ("window", self.sliding_window)) if v]
        return ", ".join(parts)
