"""Head counts and head subsets: ``check_heads`` validates H, G and D (for
layers and model configs alike); a selection keeps some heads and the
key/value groups that go with them.

Query head h reads key/value head h // (H // G). A selection keeps the
groups its query heads read; the map h' -> h' // (H' // G') must still hold
afterwards, so every kept group keeps the same number of query heads::

    H = 6, G = 3:  q0 q1 | q2 q3 | q4 q5       heads [2, 3]    -> groups [1];       H' = 2, G' = 1
                    kv0     kv1     kv2        heads [0, 2, 4] -> groups [0, 1, 2]; H' = 3, G' = 3
                                               heads [0, 2, 3] -> refused: groups keep 1, 2

``AttentionLayer.select_heads`` checks a selection here, then the kind's
``subset_heads`` builds the smaller layer: ``head_rows`` gives the rows of
the kept heads in a head-major projection, ``load_selected`` fills a layer
built on the meta device with the kept weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .._checks import positive_int

__all__ = ["check_heads", "check_head_selection", "head_rows", "load_selected"]


def check_heads(
    embed_dim: int, num_heads: int, num_kv_heads: int | None, head_dim: int | None, *, width: str = "embed_dim",
    config: bool = False,
) -> tuple[int, int, int]:
    """Validate head sizes; return (num_heads, num_kv_heads, head_dim).

    The one head-count check: layers call it, and so do model configs
    (``config=True``; ``width`` names their field, e.g. BERT's
    "hidden_size"; a config has no head_dim to decouple the widths, so its
    message gives no such hint).

    Raises:
        TypeError: a size that is not an int.
        ValueError: non-positive sizes, embed_dim not divisible by num_heads
            (when head_dim is not given), num_kv_heads not dividing num_heads.
    """
    positive_int(width, embed_dim)
    positive_int("num_heads", num_heads)
    if head_dim is None:
        if embed_dim % num_heads != 0:
            hint = "" if config else "; pass head_dim explicitly to decouple them"
            raise ValueError(f"{width}={embed_dim} is not divisible by num_heads={num_heads}{hint}")
        head_dim = embed_dim // num_heads
    positive_int("head_dim", head_dim)
    G = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
    if G > num_heads or num_heads % G != 0:
        raise ValueError(f"num_kv_heads={G} must divide num_heads={num_heads}")
    return num_heads, G, head_dim


def _indices(name: str, values: object, upper: int) -> list[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise TypeError(f"{name} must be a list of head indices, got {name}={values!r}")
    listed = list(values)
    bad = [h for h in listed if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < upper]
    if bad:
        raise ValueError(f"{name} must be ints in [0, {upper}); {bad} are not (in {name}={listed})")
    repeated = sorted({h for h in listed if listed.count(h) > 1})
    if repeated:
        raise ValueError(f"{name} lists head(s) {repeated} more than once: {listed}")
    if not listed:
        raise ValueError(f"{name} is empty; a layer keeps at least one head")
    return sorted(listed)


def check_head_selection(
    heads: object, kv_heads: object, num_heads: int, num_kv_heads: int
) -> tuple[list[int], list[int]]:
    """(kept query heads, kept key/value heads), both ascending.

    Args:
        heads: query heads to keep, in [0, H), at least one, each once.
        kv_heads: the key/value heads to keep, or None for the groups the
            kept query heads read (given, it must be exactly those).
        num_heads, num_kv_heads: H and G of the layer.

    Raises:
        TypeError: not a list of ints.
        ValueError: an index out of range or repeated, an empty selection,
            kept groups with different numbers of query heads, or
            ``kv_heads`` other than the groups the query heads read.
    """
    H, G = num_heads, num_kv_heads
    keep_q = _indices("heads", heads, H)
    r = H // G  # query heads per key/value head
    per_group = {g: sum(1 for h in keep_q if h // r == g) for g in range(G)}
    keep_kv = [g for g, n in per_group.items() if n > 0]
    if len({per_group[g] for g in keep_kv}) > 1:
        raise ValueError(
            f"query head h reads key/value head h // {r}; keeping heads {keep_q} leaves the key/value groups with "
            f"different numbers of query heads {per_group} (group: kept heads). Keep the same number of query "
            "heads in every group, or whole groups"
        )
    if kv_heads is not None:
        given = _indices("kv_heads", kv_heads, G)
        if given != keep_kv:
            raise ValueError(f"kv_heads={given} must be the key/value heads that heads={keep_q} read: {keep_kv}")
    return keep_q, keep_kv


def head_rows(heads: list[int], width: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """Row indices [len(heads) * width] of ``heads`` in a projection of head-major blocks of ``width`` rows."""
    idx = torch.tensor(heads, dtype=torch.long, device=device)
    return (offset + idx[:, None] * width + torch.arange(width, device=device)).reshape(-1)  # (n, w) -> (n*w,)


@torch.no_grad()
def load_selected(new: nn.Module, state: dict[str, torch.Tensor], old: nn.Module) -> nn.Module:
    """``new`` (built on the meta device) moved to ``old``'s device and given ``state``
    (strict), with ``old``'s requires_grad flags and training mode."""
    device = next(iter(state.values())).device
    new = new.to_empty(device=device)
    new.load_state_dict(state, strict=True)
    grads = dict(old.named_parameters())
    for name, p in new.named_parameters():
        p.requires_grad_(grads[name].requires_grad)
    return new.train(old.training)
