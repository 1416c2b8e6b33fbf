"""Which attention weights a call returns, and rebuilding them from a log-sum-exp.

``return_weights=WeightSelection(heads=[...], rows=...)`` asks
``functional.attention`` for the weights of some query heads and some query
rows only, detached (what observers and the head explorer need): an array of
[B, len(heads), len(rows), S] instead of [B, H, T, S].

The fused kernel (``sdpa`` backend) returns, with its output, the natural
log-sum-exp of each query row's scores, lse[b, h, t] = log Σ_s exp(x[b, h, t, s])
with x = q kᵀ · scale + bias over the visible keys. The weights are then
rebuilt only where asked::

    P[b, h, t, s] = exp(x[b, h, t, s] - lse[b, h, t])   at visible keys, 0 elsewhere

and each rebuilt row is divided by its sum. That sum is 1 up to the rounding
of lse: in float32 a row whose scores are near 7e5 (q = k = 300, D = 64)
knows lse only to 0.06, which would move every weight by up to 6%; the
division takes that rounding out, so the weights equal the explicit softmax
up to float rounding. A row that may see no key gets all-zero weights.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["WeightSelection", "resolve_selection", "pick", "select_weights", "rebuild_weights"]

_HALF = (torch.float16, torch.bfloat16)
BLOCK_SCORES = 1 << 19  # scores formed at a time when rebuilding weights on a CPU (2 MiB of float32) ...
MIN_BLOCK_ROWS = 16  # ... but at least this many rows per block (fewer, larger calls for large batches)
GPU_BLOCK_SCORES = 1 << 27  # on a GPU: few large blocks (each block costs kernel launches, not cache misses)


def _int_list(name: str, values: object) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list of ints, got {name}={values!r} ({type(values).__name__})")
    for x in values:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"{name} must hold ints, got {x!r} ({type(x).__name__}) in {name}={list(values)!r}")
    if not values:
        raise ValueError(f"{name} is empty: ask for at least one, or None for all")
    return tuple(int(x) for x in values)


def _ascending(values: tuple[int, ...]) -> bool:
    return all(a < b for a, b in zip(values, values[1:]))


@dataclass(frozen=True)
class WeightSelection:
    """The query heads and query rows whose weights a call returns (detached).

    Attributes:
        heads: query head indices, ascending, each once; None: every head.
        rows: query rows: a ``slice`` (resolved against each call's T, like
            Python's, so ``slice(-1, None)`` is the last query of any call),
            or ascending ints (negative ones count from the end); None: every row.

    Raises:
        TypeError: heads or rows of another type, or holding non-ints.
        ValueError: an empty list, negative or repeated heads or rows, heads
            or rows not ascending, a slice step that is not positive.
    """

    heads: tuple[int, ...] | None = None
    rows: slice | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.heads is not None:
            heads = _int_list("heads", self.heads)
            if any(h < 0 for h in heads) or not _ascending(heads):
                raise ValueError(f"heads must be ascending head indices >= 0, each once; got heads={list(heads)}")
            object.__setattr__(self, "heads", heads)
        rows = self.rows
        if isinstance(rows, range):
            rows = tuple(rows)
        if isinstance(rows, slice):
            for part in ("start", "stop", "step"):
                value = getattr(rows, part)
                if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                    raise TypeError(f"rows={rows!r}: the slice's {part} must be an int or None")
            if rows.step is not None and rows.step <= 0:
                raise ValueError(f"rows={rows!r}: the slice's step must be positive")
        elif rows is not None:
            rows = _int_list("rows", rows)
            split = next((i for i, r in enumerate(rows) if r < 0), len(rows))
            front, back = rows[:split], rows[split:]  # rows from the start, then rows from the end
            if any(r >= 0 for r in back) or not _ascending(front) or not _ascending(back):
                raise ValueError(
                    f"rows={list(rows)} are not ascending (each once; negative rows, counted from the end, come last)"
                )
        object.__setattr__(self, "rows", rows)

    @property
    def everything(self) -> bool:
        """True when every head and every row is asked for."""
        return self.heads is None and self.rows is None


def resolve_selection(selection: WeightSelection, H: int, T: int) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """The selection's (heads, rows) as ascending indices into [0, H) and [0, T); None = all.

    Raises:
        ValueError: a head >= H, or a row outside [-T, T), or rows that are
            not ascending once negative ones are counted from the end (with
            H, T and the values).
    """
    heads = selection.heads
    if heads is not None and heads[-1] >= H:
        raise ValueError(f"heads={list(heads)} asks for head {heads[-1]}, but the call has H={H} query heads")
    rows = selection.rows
    if isinstance(rows, slice):
        rows = tuple(range(T)[rows])
        if rows == tuple(range(T)):
            rows = None
    elif rows is not None:
        bad = [r for r in rows if not -T <= r < T]
        if bad:
            raise ValueError(f"rows={list(rows)} asks for row {bad[0]}, but the call has T={T} query rows")
        rows = tuple(r % T for r in rows)
        if any(a >= b for a, b in zip(rows, rows[1:])):
            raise ValueError(f"rows={list(selection.rows)} are not ascending rows of T={T} (each once)")
    if heads is not None and heads == tuple(range(H)):
        heads = None
    return heads, rows


def pick(t: torch.Tensor, heads: tuple[int, ...] | None, rows: tuple[int, ...] | None) -> torch.Tensor:
    """Heads (dim 1) and rows (dim 2) of a tensor broadcastable to [B, H, T, ...];
    a dim of size 1 (broadcast) is kept as it is."""
    if heads is not None and t.shape[1] != 1:
        t = t[:, list(heads)]  # (B, H, ...) -> (B, h, ...)
    if rows is not None and t.shape[2] != 1:
        t = t[:, :, list(rows)]  # (B, h, T, ...) -> (B, h, r, ...)
    return t


def select_weights(weights: torch.Tensor, heads: tuple[int, ...] | None, rows: tuple[int, ...] | None) -> torch.Tensor:
    """[B, H, T, S] weights -> [B, h, r, S] of the selected heads and rows."""
    return pick(weights, heads, rows)


def rebuild_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    bias: torch.Tensor | None,
    visible: torch.Tensor | None,
    heads: tuple[int, ...] | None,
    rows: tuple[int, ...] | None,
    causal_offset: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The weights of the selected heads and rows from the kernel's log-sum-exp.

    Rows are formed in blocks small enough to stay in the CPU's cache (about
    two megabytes of scores each, all selected heads at once), and with
    causality a block reads only the keys its last row may see (the rest is
    zero), as the kernel itself does. On a CPU a block is formed in one
    contiguous scratch [B·h, c, s1] (a single batched product; a strided
    destination would split it per head) and the final division writes it
    into place, so the weights' memory is written once; on a GPU in place.
    Without soft-capping, -lse rides along as one more column of the product,
    [q · scale, -lse] · [k, 1]ᵀ = q kᵀ · scale - lse, so each block's scores
    come out of the product already shifted; the causal band is zeroed after
    the exponential (``tril_`` on a block of consecutive rows).

    Args:
        q: [B, H, T, D] queries; k: [B, G, S, D] keys (head h reads h // (H // G)).
        lse: [B, H, T] natural log-sum-exp of each row's scaled, biased scores
            (float32 for half-precision inputs).
        scale: the score multiplier.
        bias: the float mask the kernel added, broadcastable to [B, H, T, S], or None.
        visible: bool, broadcastable to [B, H, T, S], True = may attend
            (before causality), or None when every key is visible.
        heads, rows: from ``resolve_selection`` (None = all).
        causal_offset: with causality, query t sees keys up to t + offset
            (0 top-left, S - T bottom-right), applied here; None without.
        softcap: c when the kernel capped the scaled scores to c·tanh(x / c)
            before adding the bias; None without.

    Returns:
        [B, h, r, S] in q's dtype, detached: 0 at hidden keys and on rows
        that may see no key, each other row summing to 1.
    """
    B, H, T, D = q.shape
    G, S = k.shape[1], k.shape[2]
    R = H // G
    compute = torch.float32 if q.dtype in _HALF else q.dtype
    with torch.no_grad():
        qs = pick(q, heads, rows)  # (B, h, r, D)
        h, r = qs.shape[1], qs.shape[2]
        lse = pick(lse, heads, rows).to(compute)  # (B, h, r)
        fold = softcap is None  # -lse as a column of the product (softcap must see the scores alone)
        width = D + 1 if fold else D
        q3 = torch.empty(B * h, r, width, dtype=compute, device=q.device)  # small: one row per query
        q3.view(B, h, r, width)[..., :D].copy_(qs).mul_(scale)  # (B, h, r, D) -> (B*h, r, D [+1])
        kv = [x // R for x in (range(H) if heads is None else heads)]  # the key head each head reads
        keys = k if kv == list(range(G)) else k[:, kv]  # (B, h, S, D): keys only, small
        ka = torch.empty(B * h, S, width, dtype=compute, device=q.device)  # (B*h, S, D [+1]), small
        ka.view(B, h, S, width)[..., :D].copy_(keys)
        if fold:
            q3[..., D] = -lse.reshape(B * h, r)
            ka[..., D] = 1.0
        kt = ka.transpose(1, 2)  # (B*h, D [+1], S): a transposed operand, read as it is by the product
        bias = None if bias is None else pick(bias, heads, rows)
        visible = None if visible is None else pick(visible, heads, rows)
        index = range(T) if rows is None else rows
        out = torch.empty(B, h, r, S, dtype=compute, device=q.device)
        out3 = out.view(B * h, r, S)
        cpu = q.device.type == "cpu"
        step = max(MIN_BLOCK_ROWS, (BLOCK_SCORES if cpu else GPU_BLOCK_SCORES) // max(1, B * h * S), 1)  # rows per block
        # On a CPU each block is formed in a contiguous scratch (one batched product, no per-head split)
        # and the division writes it into place; on a GPU in place.
        scratch = torch.empty(B * h * min(step, r) * S, dtype=compute, device=q.device) if cpu else None
        for a in range(0, r, step):
            b = min(r, a + step)
            s1 = S if causal_offset is None else min(S, max(0, index[b - 1] + causal_offset + 1))
            dest = out3[:, a:b, :s1]  # (B*h, c, s1)
            x3 = dest if scratch is None else scratch[: dest.numel()].view(dest.shape)
            torch.bmm(q3[:, a:b], kt[:, :, :s1], out=x3)  # scores (- lse)
            x = x3.view(B, h, b - a, s1) if scratch is not None else out[:, :, a:b, :s1]  # (B, h, c, s1)
            if softcap is not None:
                x.div_(softcap).tanh_().mul_(softcap)
            if bias is not None:
                x += _block(bias, a, b, s1)
            if not fold:
                x -= lse[:, :, a:b, None]
            if visible is not None:
                x.masked_fill_(~_block(visible, a, b, s1), float("-inf"))
            x3.exp_()  # hidden keys of the causal band may overflow here: zeroed next
            if causal_offset is not None:
                _zero_later_keys(x3, index, a, b, causal_offset)
            total = x3.sum(dim=-1, keepdim=True)  # (B*h, c, 1): 1 up to lse's rounding, 0 for rows that see nothing
            torch.div(x3, torch.where(total > 0, total, torch.ones((), dtype=compute, device=q.device)), out=dest)
            out3[:, a:b, s1:].zero_()
    return out.to(q.dtype)


def _zero_later_keys(x: torch.Tensor, index: Sequence[int], a: int, b: int, offset: int) -> None:
    """Zero, in place, the keys after t + offset of each query row t of a block.

    x: [N, c, s1], rows ``index[a:b]`` of the call's queries.
    """
    first = index[a]
    if index[b - 1] - first == b - 1 - a:  # consecutive rows: the band is a triangle
        x.tril_(first + offset)
        return
    positions = torch.tensor(index[a:b], device=x.device)[:, None]  # (c, 1)
    j = torch.arange(x.shape[-1], device=x.device)  # (s1,)
    x.masked_fill_(j > positions + offset, 0.0)  # (c, s1) broadcast over N


def _block(t: torch.Tensor, a: int, b: int, s1: int) -> torch.Tensor:
    """Rows a:b and keys :s1 of a tensor broadcastable to [B, h, r, S] (a row dim of 1 stays)."""
    if t.shape[2] != 1:
        t = t[:, :, a:b]
    return t[..., :s1]
