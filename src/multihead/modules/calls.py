"""Call-time checks and cache bookkeeping shared by every attention kind."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["check_input", "check_call", "rollback_on_error", "rollback_all_on_error", "default_alignment"]


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
) -> None:
    """The checks every attention forward starts with.

    Raises:
        TypeError / ValueError: as ``check_input``; value without key; key and
            value lengths that differ; a cache with cross-attention.
    """
    check_input("query", query, embed_dim)
    if key is not None:
        check_input("key", key, kdim, query)
    if value is not None:
        if key is None:
            raise ValueError("value given without key; pass key too (or neither)")
        check_input("value", value, vdim, query)
        if value.shape[1] != key.shape[1]:
            raise ValueError(f"key and value lengths differ: key={tuple(key.shape)}, value={tuple(value.shape)}")
    if kv_cache is not None and key is not None:
        raise ValueError("kv_cache is for self-attention: call with key=None and value=None")


def default_alignment(causal_alignment: str | None, kv_cache: Any) -> str:
    """Bottom-right with a cache (decoding), top-left otherwise, unless given."""
    if causal_alignment is not None:
        return causal_alignment
    return "bottom_right" if kv_cache is not None else "top_left"


@contextmanager
def rollback_on_error(kv_cache: Any) -> Iterator[None]:
    """A call that raises leaves the cache's length as it was before it."""
    length = None if kv_cache is None else kv_cache.length
    try:
        yield
    except Exception:
        if kv_cache is not None:
            kv_cache.length = length
        raise


@contextmanager
def rollback_all_on_error(kv_caches: Sequence[Any] | None) -> Iterator[None]:
    """A call that raises leaves the length of every cache as it was before it
    (a model with one cache per layer: the layers before the failing one too).

    The lengths are Python ints, so this adds nothing to a compiled graph.
    """
    lengths = None if kv_caches is None else [cache.length for cache in kv_caches]
    try:
        yield
    except Exception:
        if kv_caches is not None:
            for cache, length in zip(kv_caches, lengths):
                cache.length = length
        raise
