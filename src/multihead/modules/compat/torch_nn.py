"""A drop-in replacement for ``torch.nn.MultiheadAttention``.

``TorchMultiheadAttention`` takes exactly the inputs of the torch module,
returns what it returns, and has its attributes and parameter names
(``in_proj_weight``, ``in_proj_bias`` or ``q/k/v_proj_weight``, ``bias_k``,
``bias_v``, ``out_proj``, ``batch_first``, ``_qkv_same_embed_dim``, ...), so
it can replace ``self_attn`` / ``multihead_attn`` inside torch's
``TransformerEncoderLayer``, ``TransformerDecoderLayer``,
``TransformerEncoder`` and ``Transformer``, and state dicts load both ways.
The work is done by multihead's ``MultiHeadAttention`` (``.attention``),
which holds the *same* parameter objects (``torch_nn_state``).
Conversions happen here, at the boundary, and nowhere else:

* layout: ``batch_first=False`` inputs are (T, B, C), unbatched inputs (T, C);
* masks: torch's bool masks mean True = *may not* attend; multihead's mean
  True = may attend. A 3-D torch ``attn_mask`` is (B * H, T, S);
* ``add_bias_kv`` appends learned key/value rows, ``add_zero_attn`` a zero
  key/value, both after the projection, as torch does.

Inside torch's encoder layer in eval mode without gradients, the layer's own
fast path reads ``in_proj_weight`` & co. and runs torch's fused kernel on
these very weights (and ``TransformerEncoder`` may pass nested tensors
between such layers); everywhere else this module's forward runs.

Differences from torch, on purpose:

* a query that may attend to nothing gets zeros instead of NaN (pytorch#41508);
* the returned weights are the post-softmax weights before dropout;
* ``is_causal`` is a hint that never overrides ``attn_mask`` (torch's
  ``need_weights=False`` path replaces the mask by its own triangle, which
  hides the ``add_bias_kv``/``add_zero_attn`` key);
* wrong inputs raise ValueError/TypeError naming them, not AssertionError
  (an input of another dtype than the weights: TypeError naming both, where
  torch raises a RuntimeError from its matmul);
  ``dropout`` outside [0, 1] is refused at construction;
* nested-tensor inputs and ``torch.jit.script`` are refused with a message
  (pass padded tensors with ``key_padding_mask``; use eager or ``torch.compile``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ...functional import attention, merge_masks
from ..calls import check_dtype
from ..kinds.mha import MultiHeadAttention
from .torch_nn_masks import extra_keys, torch_attn_mask, torch_padding_mask
from .torch_nn_state import (
    TORCH_PARAMETERS,
    InProjRows,
    alias_targets,
    check_dropout,
    copy_parameter,
    init_like_torch,
    register_state_hooks,
    tie,
    untie,
)

__all__ = ["TorchMultiheadAttention"]


class TorchMultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention``'s interface over multihead's module.

    Args: as ``torch.nn.MultiheadAttention`` (``dropout`` in [0, 1]).
    Parameters are created and initialised as torch does (same shapes, same
    order, same random draws), so a seeded model is the same model.

    Raises:
        ValueError / TypeError: sizes (from ``MultiHeadAttention``: embed_dim
            divisible by num_heads, positive ints) or dropout outside [0, 1].
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        p = check_dropout(dropout)
        # Built on the meta device (no memory, no random numbers): every
        # parameter it would own is replaced by one of ours in tie().
        inner = MultiHeadAttention(
            embed_dim,
            num_heads,
            kdim=kdim,
            vdim=vdim,
            qkv_bias=bias,
            out_bias=bias,
            dropout=p if p < 1.0 else 0.0,
            device="meta",
            dtype=dtype,
        )
        factory = {"device": device, "dtype": dtype}
        C = embed_dim
        self.embed_dim, self.kdim, self.vdim = C, inner.kdim, inner.vdim
        self._qkv_same_embed_dim = inner.fused
        self.num_heads, self.head_dim = num_heads, inner.head_dim
        self.dropout = p
        self.batch_first = batch_first
        # Registration order is torch's, so parameters() lists the same
        # tensors in the same order (optimizer state dicts carry over).
        if inner.fused:
            self.in_proj_weight = nn.Parameter(torch.empty((3 * C, C), **factory))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty((C, C), **factory))
            self.k_proj_weight = nn.Parameter(torch.empty((C, self.kdim), **factory))
            self.v_proj_weight = nn.Parameter(torch.empty((C, self.vdim), **factory))
            self.register_parameter("in_proj_weight", None)
            for i, (name, width) in enumerate((("q_proj", C), ("k_proj", self.kdim), ("v_proj", self.vdim))):
                setattr(inner, name, InProjRows(slice(i * C, (i + 1) * C), width, C))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * C, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(C, C, bias=bias, **factory)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, C), **factory))
            self.bias_v = nn.Parameter(torch.empty((1, 1, C), **factory))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self.attention = inner
        tie(self)
        self._reset_parameters()
        register_state_hooks(self)

    def _reset_parameters(self) -> None:
        """torch's initialisation (``init_like_torch``); torch code calls it by this name."""
        init_like_torch(self)

    def __setattr__(self, name: str, value) -> None:
        """Assigning a torch-named parameter (or ``out_proj``) re-points the
        inner module at the same object, as torch code does with
        ``mha.in_proj_weight = linear.weight``."""
        super().__setattr__(name, value)
        if "attention" in self.__dict__.get("_modules", {}):
            for module, attr in alias_targets(self).get(name, ()):
                setattr(module, attr, value)

    def _apply(self, fn, *args, **kwargs):
        """``.to()``, ``.double()``, ``.cuda()``...: convert each shared tensor
        once (through its torch name), then re-point the inner aliases."""
        untie(self)
        try:
            return super()._apply(fn, *args, **kwargs)
        finally:
            tie(self)

    def __prepare_scriptable__(self):
        raise TypeError(
            "torch.jit.script is not supported by multihead's TorchMultiheadAttention (TorchScript cannot "
            "compile its Python forward); run it eagerly or with torch.compile, or script "
            "torch.nn.MultiheadAttention instead"
        )

    def merge_masks(self, attn_mask, key_padding_mask, query):
        """torch's mask merge for its fused encoder-layer kernel, which torch's
        ``TransformerEncoderLayer`` calls on ``self_attn`` on its fast path."""
        return nn.MultiheadAttention.merge_masks(self, attn_mask, key_padding_mask, query)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> TorchMultiheadAttention:
        """Copy a torch module's configuration and weights.

        Every parameter is copied with its dtype, device and ``requires_grad``;
        one that is None in ``module`` (``in_proj_bias`` or ``out_proj.bias``
        set to None after construction, say) is None here. No random numbers
        are drawn. The training mode is copied.

        Raises:
            TypeError: ``module`` is not a ``torch.nn.MultiheadAttention``.
            ValueError: its dropout is outside [0, 1].
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(module).__name__}")
        new = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn,
            kdim=module.kdim,
            vdim=module.vdim,
            batch_first=module.batch_first,
            device="meta",
            dtype=module.out_proj.weight.dtype,
        )
        for name in TORCH_PARAMETERS:
            setattr(new, name, copy_parameter(getattr(module, name, None)))
        for name in ("weight", "bias"):
            setattr(new.out_proj, name, copy_parameter(getattr(module.out_proj, name)))
        new.train(module.training)
        return new

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same inputs and outputs as ``torch.nn.MultiheadAttention.forward``.

        Args:
            query: [T, B, C] ([B, T, C] with ``batch_first``) or unbatched [T, C].
            key: [S, B, kdim] / [B, S, kdim] / [S, kdim].
            value: [S, B, vdim] / [B, S, vdim] / [S, vdim].
            key_padding_mask: [B, S] (unbatched [S]); bool True = ignore the
                key, or float added.
            need_weights, average_attn_weights: return the weights [B, T, S]
                (averaged over heads) or [B, H, T, S].
            attn_mask: [T, S] or [B*H, T, S] (unbatched [H, T, S]); bool True
                = may not attend, or float added.
            is_causal: a hint that ``attn_mask`` is causal; the mask decides.

        Returns:
            (output in the query's layout, weights or None).

        Raises:
            TypeError: nested tensors, non-tensors, masks that are neither
                bool nor floating, an input of another dtype than the
                projection weights (outside ``torch.autocast``).
            ValueError: ``is_causal`` without ``attn_mask`` (the flag is only
                a hint, as in torch), ranks, widths, batch sizes, key/value
                lengths, mask shapes (each naming the tensor and its shape).
        """
        unbatched = self._check_inputs(query, key, value)
        if is_causal and attn_mask is None:
            raise ValueError("is_causal=True needs attn_mask as well (as in torch, the flag is a hint)")
        self_attn = key is query and value is query
        same_kv = value is key
        if unbatched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # (T, C) -> (T, 1, C)
        if not self.batch_first or unbatched:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (T, B, C) -> (B, T, C)
        inner = self.attention
        B, T, _ = query.shape
        S = key.shape[1]
        H = inner.num_heads
        pad = torch_padding_mask(key_padding_mask, B, S, unbatched)
        mask = torch_attn_mask(attn_mask, B, H, T, S, unbatched)
        if self_attn:
            key = value = None
        elif same_kv:
            value = None
        q, k, v = self._project(query, key, value)
        k, v, mask, pad = extra_keys(k, v, mask, pad, bias_k=self.bias_k, bias_v=self.bias_v, zero=self.add_zero_attn)
        if pad is not None:
            pad = pad[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
        mask = merge_masks(mask, pad)
        p = float(self.dropout) if self.training else 0.0
        observed = inner.observed
        out = attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=0.0 if p == 1.0 else p,
            training=self.training,
            return_weights=need_weights or observed,
        )
        weights = None
        if need_weights or observed:
            out, all_weights = out
            if observed:  # observers of the inner module see this call too
                inner.notify_observers(all_weights, q, k, mask, is_causal=False, causal_alignment="top_left", v=v)
            if need_weights:
                # (B, H, T, S) -> (B, T, S) when averaged
                weights = all_weights.mean(dim=1) if average_attn_weights else all_weights
        if p == 1.0:
            out = out * 0.0  # torch's dropout with p = 1 zeroes every weight (and draws nothing)
        out = inner.run_head_hooks(out)  # (B, H, T, D): mask_heads and head_importance act here too
        out = inner.merge_heads(out)
        if not self.batch_first or unbatched:
            out = out.transpose(0, 1)  # (B, T, C) -> (T, B, C)
        if unbatched:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    def _check_inputs(self, query, key, value) -> bool:
        """Types, ranks and widths of query/key/value; returns whether unbatched."""
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.is_nested:
                raise TypeError(
                    f"nested tensors are not supported by TorchMultiheadAttention ({name} is nested); "
                    "pass padded tensors with key_padding_mask"
                )
        weight = self.in_proj_weight if self._qkv_same_embed_dim else self.q_proj_weight
        for name, t in (("query", query), ("key", key), ("value", value)):
            check_dtype(t, weight.dtype, name)
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be unbatched 2-D (T, C) or batched 3-D, got shape {tuple(query.shape)}")
        layout = "(T, {})" if query.dim() == 2 else ("(B, T, {})" if self.batch_first else "(T, B, {})")
        if query.shape[-1] != self.embed_dim:
            raise ValueError(f"query must be {layout.format(self.embed_dim)}; got {tuple(query.shape)}")
        for name, t, width in (("key", key, self.kdim), ("value", value, self.vdim)):
            if t.dim() != query.dim() or t.shape[-1] != width:
                raise ValueError(
                    f"{name} must be {query.dim()}-D like query, {layout.format(width)}; "
                    f"got query {tuple(query.shape)}, {name} {tuple(t.shape)}"
                )
        if query.dim() == 3:
            b = 0 if self.batch_first else 1
            if not key.shape[b] == value.shape[b] == query.shape[b] or key.shape[1 - b] != value.shape[1 - b]:
                raise ValueError(
                    f"query, key and value must share the batch size, key and value the length, as "
                    f"{layout.format('width')}: got query {tuple(query.shape)}, key {tuple(key.shape)}, "
                    f"value {tuple(value.shape)}"
                )
        elif key.shape[0] != value.shape[0]:
            raise ValueError(f"key and value lengths differ: key {tuple(key.shape)}, value {tuple(value.shape)}")
        return query.dim() == 2

    def _project(self, query, key, value):
        """The inner module's projection: [B, L, width] -> q [B, H, T, D],
        k and v [B, H, S, D]. An ``in_proj_bias`` of another dtype than the
        inputs is added after the matmul and promoted, as torch does."""
        inner = self.attention
        b = self.in_proj_bias
        if b is None or b.dtype == query.dtype:
            return inner.project(query, key, value)
        key = query if key is None else key
        value = key if value is None else value
        heads = []
        for (W, bias), x in zip(inner.projection_weights().values(), (query, key, value)):
            y = torch.nn.functional.linear(x, W) + bias  # (B, L, C)
            heads.append(y.view(*y.shape[:2], inner.num_heads, inner.head_dim).transpose(1, 2))  # -> (B, H, L, D)
        return tuple(heads)
