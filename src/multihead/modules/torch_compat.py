"""A drop-in replacement for ``torch.nn.MultiheadAttention``.

``TorchMultiheadAttention`` takes exactly the inputs of the torch module and
returns what it returns; the work is done by multihead's
``MultiHeadAttention`` (``.attention``). Conversions happen here, at the
boundary, and nowhere else:

* layout: ``batch_first=False`` inputs are (T, B, C), unbatched inputs (T, C);
* masks: torch's bool masks mean True = *may not* attend; multihead's mean
  True = may attend. A 3-D torch ``attn_mask`` is (B * H, T, S);
* ``add_bias_kv`` appends learned key/value rows, ``add_zero_attn`` a zero
  key/value, both after the projection, as torch does.

Differences from torch, on purpose: a query that may attend to nothing gets
zeros instead of NaN (pytorch#41508), and the returned weights are the
post-softmax weights before dropout.
"""

from __future__ import annotations

import torch
from torch import nn

from ..functional import attention, merge_masks
from .attention import MultiHeadAttention

__all__ = ["TorchMultiheadAttention"]


def _torch_mask_to_ours(mask: torch.Tensor | None) -> torch.Tensor | None:
    """torch polarity (bool True = hidden) -> multihead polarity (True = visible)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return ~mask


def _visible_columns(mask: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """Append n key columns that every query may attend to."""
    if mask is None:
        return None
    value = True if mask.dtype == torch.bool else 0.0
    extra = torch.full((*mask.shape[:-1], n), value, dtype=mask.dtype, device=mask.device)
    return torch.cat([mask, extra], dim=-1)


class TorchMultiheadAttention(nn.Module):
    """``torch.nn.MultiheadAttention``'s interface over multihead's module.

    Args: as ``torch.nn.MultiheadAttention``.
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
        self.attention = MultiHeadAttention(
            embed_dim,
            num_heads,
            kdim=kdim,
            vdim=vdim,
            qkv_bias=bias,
            out_bias=bias,
            dropout=dropout,
            device=device,
            dtype=dtype,
        )
        self.batch_first = batch_first
        self.add_zero_attn = add_zero_attn
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.zeros(1, 1, embed_dim, device=device, dtype=dtype))
            self.bias_v = nn.Parameter(torch.zeros(1, 1, embed_dim, device=device, dtype=dtype))
        else:
            self.bias_k = self.bias_v = None

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> TorchMultiheadAttention:
        """Copy a torch module's configuration and weights."""
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(f"expected torch.nn.MultiheadAttention, got {type(module).__name__}")
        ref = module.out_proj.weight
        new = cls(
            module.embed_dim,
            module.num_heads,
            dropout=module.dropout,
            bias=module.in_proj_bias is not None,
            add_bias_kv=module.bias_k is not None,
            add_zero_attn=module.add_zero_attn,
            kdim=module.kdim,
            vdim=module.vdim,
            batch_first=module.batch_first,
            device=ref.device,
            dtype=ref.dtype,
        )
        inner = new.attention
        with torch.no_grad():
            if inner.fused:
                inner.qkv_proj.weight.copy_(module.in_proj_weight)
            else:
                inner.q_proj.weight.copy_(module.q_proj_weight)
                inner.k_proj.weight.copy_(module.k_proj_weight)
                inner.v_proj.weight.copy_(module.v_proj_weight)
            if module.in_proj_bias is not None:
                if inner.fused:
                    inner.qkv_proj.bias.copy_(module.in_proj_bias)
                else:
                    for proj, b in zip((inner.q_proj, inner.k_proj, inner.v_proj), module.in_proj_bias.chunk(3)):
                        proj.bias.copy_(b)
                inner.out_proj.bias.copy_(module.out_proj.bias)
            inner.out_proj.weight.copy_(module.out_proj.weight)
            if module.bias_k is not None:
                new.bias_k.copy_(module.bias_k)
                new.bias_v.copy_(module.bias_v)
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

        Raises:
            ValueError: ``is_causal`` without ``attn_mask`` (torch requires the
                mask as well: the flag is only a hint), or bad shapes.
        """
        if is_causal and attn_mask is None:
            raise ValueError("is_causal=True needs attn_mask as well (as in torch, the flag is a hint)")
        self_attn = key is query and value is query
        same_kv = value is key
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # (T, C) -> (T, 1, C)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)  # (S,) -> (1, S)
        if not self.batch_first or unbatched:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (T, B, C) -> (B, T, C)
        inner = self.attention
        for name, t, width in (("query", query, inner.embed_dim), ("key", key, inner.kdim), ("value", value, inner.vdim)):
            if t.dim() != 3 or t.shape[-1] != width:
                raise ValueError(f"{name} must be (T, B, {width}) or (B, T, {width}); got {tuple(t.shape)}")
        B, T, _ = query.shape
        H = inner.num_heads
        if self_attn:
            key = value = None
        elif same_kv:
            value = None
        q, k, v = inner.project(query, key, value)
        mask = self._attn_mask(attn_mask, B, H, T, k.shape[2])
        pad = _torch_mask_to_ours(key_padding_mask)
        k, v, mask, pad = self._extra_keys(k, v, mask, pad)
        if pad is not None:
            pad = pad[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
        mask = merge_masks(mask, pad)
        observed = inner.observed
        out = attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=inner.dropout,
            training=self.training,
            return_weights=need_weights or observed,
        )
        weights = None
        if need_weights or observed:
            out, all_weights = out
            if observed:  # observers of the inner module see this call too
                inner.notify_observers(all_weights, q, k, mask, is_causal=False, causal_alignment="top_left")
            if need_weights:
                # (B, H, T, S) -> (B, T, S) when averaged
                weights = all_weights.mean(dim=1) if average_attn_weights else all_weights
        out = inner.merge_heads(out)
        if not self.batch_first or unbatched:
            out = out.transpose(0, 1)  # (B, T, C) -> (T, B, C)
        if unbatched:
            out = out.squeeze(1)
            weights = None if weights is None else weights.squeeze(0)
        return out, weights

    @staticmethod
    def _attn_mask(mask: torch.Tensor | None, B: int, H: int, T: int, S: int) -> torch.Tensor | None:
        if mask is None:
            return None
        mask = _torch_mask_to_ours(mask)
        if mask.dim() == 3:
            if tuple(mask.shape) != (B * H, T, S):
                raise ValueError(f"3-D attn_mask must be (B*H, T, S) = ({B * H}, {T}, {S}), got {tuple(mask.shape)}")
            return mask.view(B, H, T, S)  # (B*H, T, S) -> (B, H, T, S)
        return mask

    def _extra_keys(self, k, v, mask, pad):
        """Append torch's bias_k/bias_v row and zero row to keys, values and masks."""
        B, G, _, D = k.shape
        extra_k, extra_v = [], []
        if self.bias_k is not None:
            extra_k.append(self.bias_k.view(1, G, 1, D).expand(B, G, 1, D))  # (1, 1, C) -> (B, G, 1, D)
            extra_v.append(self.bias_v.view(1, G, 1, D).expand(B, G, 1, D))
        if self.add_zero_attn:
            extra_k.append(k.new_zeros(B, G, 1, D))
            extra_v.append(v.new_zeros(B, G, 1, D))
        if not extra_k:
            return k, v, mask, pad
        n = len(extra_k)
        k, v = torch.cat([k, *extra_k], dim=2), torch.cat([v, *extra_v], dim=2)
        return k, v, _visible_columns(mask, n), _visible_columns(pad, n)
