"""General scaled dot-product attention in NumPy float64: the specification.

Every torch implementation in multihead is tested against :func:`attention`.
It supports grouped-query heads (G key/value heads shared by H query heads),
boolean and additive masks, both causal alignments, and returns exact
post-softmax weights on request. Masked positions are removed with
``np.where`` rather than by adding ``-inf``, so whatever a masked key or value
holds (NaN and inf included) cannot reach the output.

Shape vocabulary: B batch, H query heads, G key/value heads, T query length,
S key length, D query/key head dim, Dv value head dim.
"""

import math

import numpy as np

_ALIGNMENTS = ("top_left", "bottom_right")


def causal_mask(T, S, alignment="top_left"):
    """Boolean causal mask; True = the query may attend to the key.

    ``top_left``: key j is visible to query i iff j <= i (the diagonal starts
    in the top-left corner). ``bottom_right``: iff j <= i + (S - T), so the
    last query sees every key; this is the decoding case where the T new
    queries sit at the end of an S-long cache. When T > S, the first T - S
    rows of ``bottom_right`` see nothing. For T=2, S=4 (``x`` = may attend)::

        top_left        bottom_right
            j 0 1 2 3       j 0 1 2 3
        i=0   x . . .   i=0   x x x .
        i=1   x x . .   i=1   x x x x

    Args:
        T: number of queries (rows), an int >= 0.
        S: number of keys (columns), an int >= 0.
        alignment: ``"top_left"`` or ``"bottom_right"``.

    Returns:
        bool [T, S].

    Raises:
        ValueError: if ``alignment`` is not one of the two names, or T or S
            is negative.
        TypeError: if T or S is not an int.
    """
    if alignment not in _ALIGNMENTS:
        raise ValueError(f"alignment must be one of {_ALIGNMENTS}, got {alignment!r}")
    for name, n in (("T", T), ("S", S)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {n!r} of type {type(n).__name__}")
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
    offset = 0 if alignment == "top_left" else S - T
    i = np.arange(T)[:, None]  # (T, 1) query index
    j = np.arange(S)[None, :]  # (1, S) key index
    return j <= i + offset  # (T, S)


def _check_mask(mask, B, H, T, S):
    """Validate a user mask; returns it as a (B, H, T, S) bool or float64 view."""
    mask = np.asarray(mask)
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.floating):
        raise TypeError(
            "mask must be bool (True = may attend) or floating (added to the scores), "
            f"got dtype {mask.dtype}"
        )
    target = (B, H, T, S)
    accepted = f"(T, S) = {(T, S)} or a 4-D shape broadcastable to (B, H, T, S) = {target}"
    if mask.ndim == 2:
        ok = mask.shape == (T, S)
    elif mask.ndim == 4:
        ok = all(m in (1, t) for m, t in zip(mask.shape, target, strict=True))
    else:
        ok = False
    if not ok:
        raise ValueError(f"mask must have shape {accepted}, got {mask.shape}")
    if mask.dtype != np.bool_:
        mask = mask.astype(np.float64)
    return np.broadcast_to(mask, target)


def attention(
    q,
    k,
    v,
    mask=None,
    is_causal=False,
    causal_alignment="top_left",
    scale=None,
    return_weights=False,
    sinks=None,
    window=None,
):
    """Scaled dot-product attention with grouped-query heads, masks, sinks and windows.

    For each batch b, query head h and query t, with allowed(b, h, t, s) the
    positions the query may attend to::

        score[s]  = scale * q[b, h, t] . k[b, g, s]  (+ mask[b, h, t, s] if float)
        p[s]      = exp(score[s]) / sum over allowed s' of exp(score[s'])
        out[b, h, t] = sum over allowed s of p[s] * v[b, g, s]

    where g = h // (H // G) is the key/value group of query head h
    (``repeat_interleave`` order, not ``tile`` order). For H=4, G=2::

        query head h : 0 1 2 3
        kv group   g : 0 0 1 1

    ``allowed`` is the logical AND of the bool mask (True = may attend), the
    float mask's entries that are not ``-inf``, and the causal mask when
    ``is_causal``. Positions that are not allowed are dropped with
    ``np.where`` and contribute nothing, even if k, v or the float mask hold
    NaN or inf there; a NaN at an allowed position propagates as in IEEE
    arithmetic. A query with no allowed key (or whose allowed scores are all
    ``-inf``) gets output 0 and weights 0, without NaN or warnings.

    Args:
        q: [B, H, T, D] queries.
        k: [B, G, S, D] keys; G >= 1 must divide H.
        v: [B, G, S, Dv] values.
        mask: None, a bool array (True = may attend) or a floating array
            (added to the scores; ``-inf`` = may not attend). Its shape must
            be exactly [T, S], or 4-D and broadcastable to [B, H, T, S].
        is_causal: also apply :func:`causal_mask` (T, S, causal_alignment).
        causal_alignment: ``"top_left"`` or ``"bottom_right"``; checked
            even when ``is_causal`` is False.
        scale: factor on q . k; defaults to 1 / sqrt(D).
        return_weights: also return the post-softmax weights.
        sinks: None or [H] sink logits (gpt-oss): the softmax of each row of
            head h runs over its allowed scores plus s_h, and s_h's share
            mixes no value::

                p[s] = exp(score[s]) / (exp(sinks[h]) + sum over allowed s' of exp(score[s']))

            so rows sum to less than 1, and a row with no allowed key has
            weights 0 and output 0.
        window: None or an int >= 1: key s is allowed to query t only when
            t' - window < s <= t', t' = t + offset the query's aligned
            position (offset 0 top-left, S - T bottom-right; the query and
            the window - 1 keys before it).

    Returns:
        out [B, H, T, Dv] (float64), or ``(out, weights)`` with weights
        [B, H, T, S], exactly 0 at positions that are not allowed.

    Raises:
        ValueError: if q, k or v is not 4-D, batch sizes differ, G does not
            divide H (or G < 1), k and v disagree in G or S, q and k disagree
            in D, D = 0 with ``scale=None``, the mask has a shape other than
            those above, or ``causal_alignment`` is unknown.
        TypeError: if the mask is neither bool nor floating (e.g. integer).
    """
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(
            f"causal_alignment must be one of {_ALIGNMENTS}, got {causal_alignment!r}"
        )
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    if not q.ndim == k.ndim == v.ndim == 4:
        raise ValueError(
            "q, k, v must be 4-D: q (B, H, T, D), k (B, G, S, D), v (B, G, S, Dv); "
            f"got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    B, H, T, D = q.shape
    _, G, S, _ = k.shape
    shapes = f"q {q.shape}, k {k.shape}, v {v.shape}"
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v must share the batch size B, got {shapes}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(
            f"k and v must share G and S: k (B, G, S, D), v (B, G, S, Dv); got {shapes}"
        )
    if G < 1 or G > H or H % G != 0:
        raise ValueError(
            f"G (k/v heads) must be >= 1 and divide H (q heads); got H={H}, G={G}: {shapes}"
        )
    if k.shape[3] != D:
        raise ValueError(f"q and k must share the head dim D, got {shapes}")
    if scale is None:
        if D == 0:
            raise ValueError(f"scale=None needs D >= 1 (scale = 1/sqrt(D)), got {shapes}")
        scale = 1.0 / math.sqrt(D)

    # Grouped-query map: query head h reads key/value head h // (H // G).
    group = np.arange(H) // (H // G)  # (H,), e.g. [0, 0, 1, 1] for H=4, G=2
    k_h = k[:, group]  # (B, G, S, D) -> (B, H, S, D)
    v_h = v[:, group]  # (B, G, S, Dv) -> (B, H, S, Dv)

    allowed = np.ones((B, H, T, S), dtype=bool)
    bias = np.zeros((B, H, T, S))
    if mask is not None:
        mask = _check_mask(mask, B, H, T, S)  # (B, H, T, S) view
        if mask.dtype == np.bool_:
            allowed &= mask
        else:
            allowed &= ~np.isneginf(mask)
            bias = mask
    if is_causal:
        allowed &= causal_mask(T, S, causal_alignment)  # (T, S) broadcasts
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        pos = np.arange(T)[:, None] + (0 if causal_alignment == "top_left" else S - T)  # (T, 1)
        j = np.arange(S)[None, :]  # (1, S)
        allowed &= (j <= pos) & (j > pos - window)
    sink = np.full((1, H, 1, 1), -np.inf)
    if sinks is not None:
        sink = np.asarray(sinks, dtype=np.float64)
        if sink.shape != (H,):
            raise ValueError(f"sinks must have shape (H,) = ({H},), got {sink.shape}")
        sink = sink[None, :, None, None]  # (H,) -> (1, H, 1, 1)

    # Masked positions may hold NaN/inf: silence IEEE warnings for the raw
    # arithmetic, then keep only the allowed entries with np.where.
    with np.errstate(invalid="ignore", over="ignore"):
        raw = scale * np.einsum("bhtd,bhsd->bhts", q, k_h) + bias  # (B, H, T, S)
        scores = np.where(allowed, raw, -np.inf)
        row_max = scores.max(axis=-1, keepdims=True) if S else np.full((B, H, T, 1), -np.inf)
        row_max = np.maximum(row_max, sink)  # the sink's logit counts (-inf without sinks)
        row_max = np.where(np.isneginf(row_max), 0.0, row_max)  # empty rows
        e = np.where(allowed, np.exp(scores - row_max), 0.0)
        total = e.sum(axis=-1, keepdims=True) + np.exp(sink - row_max)  # (B, H, T, 1)
        weights = np.divide(e, total, out=np.zeros_like(e), where=total != 0)
        # (B, H, T, S, 1) * (B, H, 1, S, Dv) -> (B, H, T, S, Dv), summed over S
        terms = weights[..., None] * v_h[:, :, None, :, :]
        out = np.where(allowed[..., None], terms, 0.0).sum(axis=-2)  # (B, H, T, Dv)
    return (out, weights) if return_weights else out
