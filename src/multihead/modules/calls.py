"""Call-time checks and cache bookkeeping shared by every attention kind."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "check_input",
    "check_call",
    "check_dtype",
    "check_cache_use",
    "check_forward_options",
    "key_padding",
    "rollback_on_error",
    "rollback_all_on_error",
    "default_alignment",
]


def check_input(name: str, x: object, width: int, query: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` must be a (B, T, width) tensor matching ``query``'s batch, dtype, device.

    Raises:
        TypeError: not a tensor.
        ValueError: wrong rank or width, batch/dtype/device unlike the query.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != width:
        raise ValueError(f"{name} must be (B, T, {width}), got {tuple(x.shape)}")
    if query is not None:
        if x.shape[0] != query.shape[0]:
            raise ValueError(
                f"{name} batch {x.shape[0]} != query batch {query.shape[0]}: "
                f"query={tuple(query.shape)}, {name}={tuple(x.shape)}"
            )
        if x.dtype != query.dtype or x.device != query.device:
            raise ValueError(
                f"query and {name} differ in dtype/device: query {query.dtype} on {query.device}, "
                f"{name} {x.dtype} on {x.device}"
            )
    return x


def check_call(
    query: object,
    key: object,
    value: object,
    kv_cache: Any,
    *,
    embed_dim: int,
    kdim: int,
    vdim: int,
    dtype: torch.dtype | None = None,
) -> None:
    """The checks every attention forward starts with.

    Args:
        dtype: the layer's parameter dtype; a query of another floating
            dtype is refused (except under ``torch.autocast``, which casts
            inside the layer).

    Raises:
        TypeError: as ``check_input``; a query dtype other than ``dtype``
            (the message names both).
        ValueError: as ``check_input``; value without key; key and value
            lengths that differ.
    """
    check_input("query", query, embed_dim)
    check_dtype(query, dtype)
    if key is not None:
        check_input("key", key, kdim, query)
    if value is not None:
        if key is None:
            raise ValueError("value given without key; pass key too (or neither)")
        check_input("value", value, vdim, query)
        if value.shape[1] != key.shape[1]:
            raise ValueError(f"key and value lengths differ: key={tuple(key.shape)}, value={tuple(value.shape)}")


def check_dtype(x: torch.Tensor, dtype: torch.dtype | None, name: str = "query") -> None:
    """Refuse an input whose dtype differs from ``dtype`` (the layer's parameters'), outside autocast.

    Raises:
        TypeError: e.g. "query has dtype torch.float64 but the layer's parameters are torch.float32".
    """
    if dtype is None or x.dtype == dtype or torch.is_autocast_enabled(x.device.type):
        return
    raise TypeError(
        f"{name} has dtype {x.dtype} but the layer's parameters are {dtype}: convert one to the other "
        f"({name}.to({dtype}) or module.to({x.dtype}))"
    )


def check_cache_use(kv_cache: Any, key: torch.Tensor | None) -> bool:
    """Check how one call uses ``kv_cache``; True when it reuses cross-attention keys.

    Self-attention (``key`` None) appends to a self-attention cache.
    Cross-attention (``key`` given) fills an empty cache with the keys of
    ``key``, or reuses a cache that the same key tensor filled. In eager mode
    the cache remembers the key tensor that filled it (``KVCache.cross_source``).

    Raises:
        ValueError: a self-attention call on a cross-attention cache or the
            reverse, or a filled cache used with another key tensor.
    """
    eager = not torch.compiler.is_compiling()
    source = getattr(kv_cache, "cross_source", None) if eager else None
    if key is None:
        if source is not None:
            raise ValueError("kv_cache holds cross-attention keys (filled by a call with key): pass that key")
        return False
    length = kv_cache.length
    if length == 0:
        if eager:
            kv_cache.cross_source = key
        return False
    if eager and source is None:
        raise ValueError(
            f"kv_cache holds {length} self-attention positions (calls with key=None); a cross-attention "
            "cache is an empty one that a call with key fills"
        )
    if length != key.shape[1] or (eager and source is not key):
        raise ValueError(
            f"kv_cache holds the keys of another key tensor ({length} positions; key {tuple(key.shape)}): "
            "pass the key tensor that filled it, or reset() the cache"
        )
    return True


def check_forward_options(layer: Any, backend: str, options: dict) -> None:
    """``backend`` must be one of the layer's ``backends`` (None: any), and the extra
    keyword arguments of its forward must be its kind's ``forward_options``.

    Raises:
        ValueError: a backend the kind's core does not take (listing those it does).
        TypeError: unknown keyword arguments (listing the kind's own).
    """
    if layer.backends is not None and backend not in layer.backends:
        raise ValueError(f"backend={backend!r}: {layer.kind} supports backend in {list(layer.backends)}")
    unknown = sorted(set(options) - set(layer.forward_options))
    if unknown:
        extra = f"; its own: {list(layer.forward_options)}" if layer.forward_options else ""
        raise TypeError(f"{type(layer).__name__}.forward() got unexpected keyword argument(s) {unknown}{extra}")


def refuse_torch_padding(options: dict) -> None:
    """torch's ``key_padding_mask`` has the opposite polarity of ``key_mask``: refuse it by name.

    Raises:
        TypeError: ``key_padding_mask`` among the keyword arguments.
    """
    if "key_padding_mask" in options:
        raise TypeError(
            "multihead attention layers take key_mask (True = may attend, a real key), not torch's "
            "key_padding_mask (True = padding, ignore): pass key_mask=~key_padding_mask, "
            "or use multihead.TorchMultiheadAttention, which keeps torch's argument and meaning"
        )


def key_padding(mask: object, B: int, S: int) -> torch.Tensor | None:
    """A [B, S] key_mask (bool True = may attend, or float added) as (B, 1, 1, S).

    Raises:
        TypeError: not a tensor, or neither bool nor floating.
        ValueError: a shape other than (B, S).
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"key_mask must be bool or floating, got dtype {mask.dtype}")
    if tuple(mask.shape) != (B, S):
        raise ValueError(f"key_mask must be (B, S) = ({B}, {S}), got {tuple(mask.shape)}")
    return mask[:, None, None, :]  # (B, S) -> (B, 1, 1, S)


def default_alignment(causal_alignment: str | None, kv_cache: Any) -> str:
    """Bottom-right with a cache (decoding), top-left otherwise, unless given."""
    if causal_alignment is not None:
        return causal_alignment
    return "bottom_right" if kv_cache is not None else "top_left"


@contextmanager
def rollback_on_error(kv_cache: Any) -> Iterator[None]:
    """A call that raises leaves the cache as it was before it (``KVCache.save_state``:
    its length, or a window cache's kept keys too)."""
    state = None if kv_cache is None else kv_cache.save_state()
    try:
        yield
    except Exception:
        if kv_cache is not None:
            kv_cache.restore_state(state)
        raise


@contextmanager
def rollback_all_on_error(kv_caches: Sequence[Any] | None) -> Iterator[None]:
    """A call that raises leaves every cache as it was before it (a model with
    one cache per layer: the layers before the failing one too).

    A state is a Python int (the length) or references to a window cache's
    tensors, so this adds no copy to a compiled graph.
    """
    states = None if kv_caches is None else [cache.save_state() for cache in kv_caches]
    try:
        yield
    except Exception:
        if kv_caches is not None:
            for cache, state in zip(kv_caches, states):
                cache.restore_state(state)
        raise
