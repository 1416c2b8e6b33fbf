"""A head's strongest query -> key weights, as links between tokens.

    strongest_links(weights [T, S], query_tokens, key_tokens, k=3)
        -> [Link(query="cat", key="the", weight=0.91, query_index=2, key_index=1), ...]

``tools.roles`` keeps each head's links in ``HeadRoles.links``;
``multihead inspect`` prints them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .._checks import positive_int
from .token_kinds import is_special

__all__ = ["Link", "strongest_links"]


class Link(NamedTuple):
    """One query -> key weight of a head."""

    query: str
    key: str
    weight: float
    query_index: int
    key_index: int


def strongest_links(
    weights: torch.Tensor,
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    k: int = 3,
    *,
    skip_special: bool = True,
) -> list[Link]:
    """The ``k`` strongest non-zero weights (largest ``|w|``) of one head as links.

    Args:
        weights: [T, S] weights of one head.
        query_tokens: T token strings.
        key_tokens: S token strings.
        k: how many links at most.
        skip_special: leave out links to special keys ([CLS], [SEP], ...),
            which Clark et al. 2019 read as "no-op" attention and which would
            otherwise crowd out every other link.

    Returns:
        links sorted by ``|weight|`` (largest first), ties by query then key
        index; ``Link.weight`` keeps the sign (signed weights come from
        heads mixed after the softmax, e.g. DCMHA).

    Raises:
        TypeError: weights not a tensor, k not an int.
        ValueError: weights not 2-D, token lists of the wrong length, k < 1.
    """
    if not isinstance(weights, torch.Tensor):
        raise TypeError(f"weights must be a torch.Tensor, got {type(weights).__name__}")
    if weights.dim() != 2:
        raise ValueError(f"weights must be [T, S], got shape {tuple(weights.shape)}")
    k = positive_int("k", k)
    T, S = weights.shape
    if len(query_tokens) != T or len(key_tokens) != S:
        raise ValueError(
            f"weights [T, S] = [{T}, {S}] need {T} query and {S} key tokens, "
            f"got len(query_tokens)={len(query_tokens)}, len(key_tokens)={len(key_tokens)}"
        )
    w = weights.detach().double().cpu()
    if skip_special:
        keep = torch.tensor([not is_special(t) for t in key_tokens], dtype=torch.bool)
        w = torch.where(keep, w, torch.zeros_like(w))
    flat = w.reshape(-1)
    # stable sort on the negated magnitudes keeps row-major order among ties
    order = torch.sort(-flat.abs(), stable=True).indices[:k]
    return [
        Link(query_tokens[i // S], key_tokens[i % S], float(flat[i]), i // S, i % S)
        for i in order.tolist()
        if flat[i] != 0
    ]
