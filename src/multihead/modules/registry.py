"""Attention kinds by name: ``build_attention("gqa", embed_dim=..., num_heads=...)``.

Models choose their attention by name (``GPTConfig(attention="mqa")``), so
the same model compares attention kinds. Every kind is a subclass of
``base.AttentionLayer`` and so has the same interface:

    forward(query, key=None, value=None, *, attn_mask=None,
            key_padding_mask=None, is_causal=False, return_weights=False,
            kv_cache=None, positions=None) -> out [B, T, C] (or (out, weights))
    make_kv_cache(batch_size, max_len) -> cache for ``kv_cache=``
    aux_loss() -> the training loss term of the last forward, 0-d
    cost(T, S) -> FLOPs, parameters, cache bytes
    out_proj -> the output projection (models initialise it)
    kind -> the registry name (a str attribute)

``kind`` is a class attribute of every attention class (``MoHAttention.kind
== "moh"``), never a property. A class that serves several names sets the
instance's name in ``__init__`` as a plain attribute over its class
attribute's family name: ``MultiHeadAttention.kind == "mha"``, and an instance
with num_kv_heads == 1 has ``kind == "mqa"``, with 1 < num_kv_heads <
num_heads ``"gqa"``. The instance's ``kind`` is the name observers' events
carry; it is the name the module was built by, except that a configuration
another name describes exactly carries that name (``build_attention("gqa",
num_kv_heads=num_heads)`` is an "mha").

``aux_loss()`` is a method on every kind: the loss term the last forward
asks the training loop to add (MoH's weighted load-balance loss, the gated
kind's L0 penalty), with its gradient; a 0-d zero on the module's device and
dtype for kinds without one and after an eval-mode forward. Models
(``GPT``, ``BertEncoder``, ``Transformer``) sum it over their attention
modules with :func:`total_aux_loss`; a training loop adds
``model.aux_loss()`` to its loss.

Kinds register themselves with ``@register_attention(name)`` in their own
module, and that is the only way a name enters the registry: importing
``multihead`` imports every kind's module (``multihead.modules``), so every
kind is registered before anything can be built. An unknown name raises
ValueError listing the known ones; a name registered twice is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["build_attention", "register_attention", "list_attention_kinds", "total_aux_loss"]

Builder = Callable[..., nn.Module]
_KINDS: dict[str, Builder] = {}


def register_attention(name: str) -> Callable[[Builder], Builder]:
    """Decorator: register ``builder(*, embed_dim, num_heads, **options)``."""

    if not isinstance(name, str) or not name:
        raise TypeError(f"an attention kind's name must be a non-empty str, got {name!r}")

    def deco(builder: Builder) -> Builder:
        if name in _KINDS and _KINDS[name] is not builder:
            raise ValueError(f"attention kind {name!r} is already registered by {_KINDS[name].__qualname__}")
        _KINDS[name] = builder
        return builder

    return deco


def list_attention_kinds() -> list[str]:
    """The names ``build_attention`` accepts, sorted."""
    return sorted(_KINDS)


def build_attention(name: str, *, embed_dim: int, num_heads: int, **options) -> nn.Module:
    """Build the attention kind ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones) or
            options the kind rejects.
    """
    if name not in _KINDS:
        raise ValueError(f"unknown attention kind {name!r}; known: {list_attention_kinds()}")
    return _KINDS[name](embed_dim=embed_dim, num_heads=num_heads, **options)


def total_aux_loss(modules: Iterable[nn.Module], like: torch.Tensor) -> torch.Tensor:
    """Sum of ``m.aux_loss()`` over attention ``modules``, with its gradient.

    Args:
        modules: attention modules (each has the ``aux_loss()`` method).
        like: a tensor whose device and dtype the 0-d zero start takes.

    Returns:
        A 0-d tensor: 0 + the modules' terms (exactly 0 when there is none).
    """
    total = torch.zeros((), device=like.device, dtype=like.dtype)
    for m in modules:
        total = total + m.aux_loss()
    return total

