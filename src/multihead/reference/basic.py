"""Textbook multi-head attention in NumPy float64.

These are the forms a reader meets first: one head, a list of heads computed
one by one, the same heads as a tensor axis, and the same again with einsum.
They follow the structure of Eli Bendersky's tutorial on multi-head attention
in NumPy (argument names and orders included), rewritten here as a spec.

Shape vocabulary used below: B batch, N sequence length, D model width,
NH number of heads, HS head size (HS = D // NH for the fused forms).

The fused weight ``W`` of the vectorised forms is ``[Wq | Wk | Wv]`` along its
last axis, shape (D, 3*D). Inside each (D, D) block, head ``i`` owns columns
``i*HS:(i+1)*HS``; in the output projection ``Wp`` (D, D) it owns rows
``i*HS:(i+1)*HS``. That layout makes the fused forms equal to the list form.
"""

import math

import numpy as np


def softmax(x, axis=-1):
    """Numerically stable softmax along one axis.

    The maximum along ``axis`` is subtracted before exponentiating, so large
    inputs (1e4) stay finite. A slice whose entries are all ``-inf`` has
    nothing to attend to and returns zeros, silently. A NaN anywhere in a
    slice makes that whole slice NaN; a ``+inf`` entry also gives NaN.

    Args:
        x: array-like of any shape; computed in float64.
        axis: the axis to normalise over.

    Returns:
        float64 array, same shape as ``x``; each slice sums to 1, or is all
        zeros when it was all ``-inf``.

    Raises:
        numpy.exceptions.AxisError: if ``axis`` is out of range for ``x``.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return x.copy()
    m = np.max(x, axis=axis, keepdims=True)
    # An all -inf slice has max -inf; shift it by 0 so exp(-inf) = 0.
    m = np.where(np.isneginf(m), 0.0, m)
    with np.errstate(invalid="ignore"):  # inf - inf -> NaN, on purpose
        e = np.exp(x - m)
    total = e.sum(axis=axis, keepdims=True)
    # total == 0 only for an all -inf slice: leave those entries at 0.
    return np.divide(e, total, out=np.zeros_like(e), where=total != 0)


def _as_matrix(name, w, D):
    """float64 (D, HS) weight matrix; ValueError naming ``name`` otherwise."""
    w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != D:
        raise ValueError(f"{name} must have shape (D, HS) with D = {D}, got shape {w.shape}")
    return w


def _causal(n):
    """bool (n, n) lower-triangular mask; True = may attend."""
    return np.tril(np.ones((n, n), dtype=bool))


def _one_head(q, k, v, do_mask):
    """softmax(q kᵀ / sqrt(HS)) v for q (B, Nq, HS), k (B, Nk, HS), v (B, Nk, HSv)."""
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])  # (B, Nq, Nk)
    if do_mask:
        scores = np.where(_causal(scores.shape[-1]), scores, -np.inf)
    return softmax(scores, axis=-1) @ v  # (B, Nq, HSv)


def self_attention(x, Wk, Wq, Wv):
    """Single-head self-attention (note the tutorial's order Wk, Wq, Wv).

    Args:
        x: [N, D] or batched [B, N, D] input sequence.
        Wk: [D, HS] key projection.
        Wq: [D, HS] query projection.
        Wv: [D, HS] value projection.

    Returns:
        [N, HS] or [B, N, HS]: softmax(q kᵀ / sqrt(HS)) v with q = x Wq,
        k = x Wk, v = x Wv.

    Raises:
        ValueError: if ``x`` is not 2-D or 3-D, or the weights are not all
            (D, HS) with the same D and HS.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim not in (2, 3):
        raise ValueError(f"x must be (N, D) or (B, N, D), got shape {x.shape}")
    D = x.shape[-1]
    Wk, Wq, Wv = (_as_matrix(n, w, D) for n, w in (("Wk", Wk), ("Wq", Wq), ("Wv", Wv)))
    if not Wk.shape == Wq.shape == Wv.shape:
        raise ValueError(
            f"Wk, Wq, Wv must share one shape (D, HS), got {Wk.shape}, {Wq.shape}, {Wv.shape}"
        )
    q, k, v = x @ Wq, x @ Wk, x @ Wv  # (..., N, D) -> (..., N, HS)
    return _one_head(q, k, v, do_mask=False)


def _check_head_lists(D, Wqs, Wks, Wvs, Wp):
    """Validate per-head weight lists; returns them and Wp as float64 arrays."""
    if not len(Wqs) == len(Wks) == len(Wvs) >= 1:
        raise ValueError(
            "Wqs, Wks, Wvs must be non-empty lists of equal length NH, got lengths "
            f"{len(Wqs)}, {len(Wks)}, {len(Wvs)}"
        )
    lists = []
    for name, ws in (("Wqs", Wqs), ("Wks", Wks), ("Wvs", Wvs)):
        lists.append([_as_matrix(f"{name}[{i}]", w, D) for i, w in enumerate(ws)])
    shapes = {w.shape for ws in lists for w in ws}
    if len(shapes) != 1:
        raise ValueError(
            f"all per-head weights must share one shape (D, HS), got {sorted(shapes)}"
        )
    NH, HS = len(Wqs), lists[0][0].shape[1]
    Wp = np.asarray(Wp, dtype=np.float64)
    if Wp.shape != (NH * HS, D):
        raise ValueError(f"Wp must have shape (NH*HS, D) = ({NH * HS}, {D}), got {Wp.shape}")
    return (*lists, Wp)


def multihead_attention_list(x, Wqs, Wks, Wvs, Wp, do_mask=False):
    """Multi-head self-attention, one head at a time.

    Args:
        x: [B, N, D] input sequence.
        Wqs: list of NH query projections, each [D, HS].
        Wks: list of NH key projections, each [D, HS].
        Wvs: list of NH value projections, each [D, HS].
        Wp: [NH*HS, D] output projection.
        do_mask: apply the causal mask (query i sees keys 0..i).

    Returns:
        [B, N, D]: the heads' outputs concatenated head-major along the last
        axis, then multiplied by ``Wp``.

    Raises:
        ValueError: if ``x`` is not 3-D, the lists are empty or of unequal
            length, or any weight shape disagrees with D, HS or NH.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 3:
        raise ValueError(f"x must be (B, N, D), got shape {x.shape}")
    Wqs, Wks, Wvs, Wp = _check_head_lists(x.shape[-1], Wqs, Wks, Wvs, Wp)
    heads = [
        _one_head(x @ Wq, x @ Wk, x @ Wv, do_mask)  # each (B, N, HS)
        for Wq, Wk, Wv in zip(Wqs, Wks, Wvs, strict=True)
    ]
    return np.concatenate(heads, axis=-1) @ Wp  # (B, N, NH*HS) -> (B, N, D)


def multihead_cross_attention_list(xq, xv, Wqs, Wks, Wvs, Wp):
    """Multi-head cross-attention, one head at a time.

    Queries come from ``xq``; keys and values both come from ``xv``. Each
    weight list is used for its own role (q = xq Wq, k = xv Wk, v = xv Wv).

    Args:
        xq: [B, Nq, D] sequence that asks (the queries).
        xv: [B, Nv, D] sequence that is read (the keys and values).
        Wqs: list of NH query projections, each [D, HS].
        Wks: list of NH key projections, each [D, HS].
        Wvs: list of NH value projections, each [D, HS].
        Wp: [NH*HS, D] output projection.

    Returns:
        [B, Nq, D].

    Raises:
        ValueError: if ``xq`` or ``xv`` is not 3-D, their B or D differ, or
            any weight shape disagrees (as in multihead_attention_list).
    """
    xq = np.asarray(xq, dtype=np.float64)
    xv = np.asarray(xv, dtype=np.float64)
    if xq.ndim != 3 or xv.ndim != 3:
        raise ValueError(f"xq and xv must be (B, N, D), got shapes {xq.shape} and {xv.shape}")
    if xq.shape[0] != xv.shape[0] or xq.shape[2] != xv.shape[2]:
        raise ValueError(
            f"xq (B, Nq, D) and xv (B, Nv, D) must share B and D, got {xq.shape} and {xv.shape}"
        )
    Wqs, Wks, Wvs, Wp = _check_head_lists(xq.shape[-1], Wqs, Wks, Wvs, Wp)
    heads = [
        _one_head(xq @ Wq, xv @ Wk, xv @ Wv, do_mask=False)  # each (B, Nq, HS)
        for Wq, Wk, Wv in zip(Wqs, Wks, Wvs, strict=True)
    ]
    return np.concatenate(heads, axis=-1) @ Wp  # (B, Nq, NH*HS) -> (B, Nq, D)


def _check_fused(x, W, NH, Wp):
    """Validate the fused forms' inputs; returns x, W, Wp (float64) and HS."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 3:
        raise ValueError(f"x must be (B, N, D), got shape {x.shape}")
    if isinstance(NH, bool) or not isinstance(NH, (int, np.integer)):
        raise TypeError(f"NH must be an int, got {NH!r} of type {type(NH).__name__}")
    D = x.shape[-1]
    if NH < 1 or D % NH != 0:
        raise ValueError(f"NH must be a positive divisor of D = {D}, got NH = {NH}")
    W = np.asarray(W, dtype=np.float64)
    if W.shape != (D, 3 * D):
        raise ValueError(
            f"W must be [Wq | Wk | Wv] of shape (D, 3*D) = ({D}, {3 * D}), got {W.shape}"
        )
    Wp = np.asarray(Wp, dtype=np.float64)
    if Wp.shape != (D, D):
        raise ValueError(f"Wp must have shape (D, D) = ({D}, {D}), got {Wp.shape}")
    return x, W, Wp, D // NH


def multihead_attention_vec(x, W, NH, Wp, do_mask=False):
    """Multi-head self-attention with the heads as an array axis.

    Args:
        x: [B, N, D] input sequence.
        W: [D, 3*D] fused projection [Wq | Wk | Wv]; head i owns columns
            i*HS:(i+1)*HS of each block, HS = D // NH.
        NH: number of heads; must divide D.
        Wp: [D, D] output projection.
        do_mask: apply the causal mask (query i sees keys 0..i).

    Returns:
        [B, N, D]; equal to multihead_attention_list with the per-head
        matrices cut out of ``W`` as described above.

    Raises:
        TypeError: if ``NH`` is not an int.
        ValueError: if ``x`` is not 3-D, NH does not divide D, or ``W`` or
            ``Wp`` has the wrong shape.
    """
    x, W, Wp, HS = _check_fused(x, W, NH, Wp)
    B, N, D = x.shape
    q, k, v = np.split(x @ W, 3, axis=-1)  # (B, N, 3D) -> 3 x (B, N, D)
    # (B, N, D) -> (B, N, NH, HS) -> (B, NH, N, HS)
    q, k, v = (a.reshape(B, N, NH, HS).transpose(0, 2, 1, 3) for a in (q, k, v))
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(HS)  # (B, NH, N, N)
    if do_mask:
        scores = np.where(_causal(N), scores, -np.inf)
    heads = softmax(scores, axis=-1) @ v  # (B, NH, N, HS)
    # (B, NH, N, HS) -> (B, N, NH, HS) -> (B, N, D)
    concat = heads.transpose(0, 2, 1, 3).reshape(B, N, D)
    return concat @ Wp  # (B, N, D)


def multihead_attention_einsum(x, W, NH, Wp, do_mask=False):
    """Multi-head self-attention written with np.einsum.

    Same arguments, result and layout as multihead_attention_vec; the head
    split is done by reshaping the weights instead of the activations.

    Args:
        x: [B, N, D] input sequence.
        W: [D, 3*D] fused projection [Wq | Wk | Wv].
        NH: number of heads; must divide D.
        Wp: [D, D] output projection.
        do_mask: apply the causal mask (query i sees keys 0..i).

    Returns:
        [B, N, D].

    Raises:
        TypeError: if ``NH`` is not an int.
        ValueError: if ``x`` is not 3-D, NH does not divide D, or ``W`` or
            ``Wp`` has the wrong shape.
    """
    x, W, Wp, HS = _check_fused(x, W, NH, Wp)
    D = x.shape[-1]
    # (D, 3D) -> (D, 3, NH, HS): block c in {q, k, v}, head h, column e.
    Wqkv = W.reshape(D, 3, NH, HS)
    q = np.einsum("bnd,dhe->bhne", x, Wqkv[:, 0])  # (B, NH, N, HS)
    k = np.einsum("bnd,dhe->bhne", x, Wqkv[:, 1])  # (B, NH, N, HS)
    v = np.einsum("bnd,dhe->bhne", x, Wqkv[:, 2])  # (B, NH, N, HS)
    scores = np.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(HS)  # (B, NH, N, N)
    if do_mask:
        scores = np.where(_causal(x.shape[1]), scores, -np.inf)
    p = softmax(scores, axis=-1)
    heads = np.einsum("bhqk,bhkd->bhqd", p, v)  # (B, NH, N, HS)
    # (D, D) -> (NH, HS, D): rows i*HS:(i+1)*HS of Wp belong to head i.
    return np.einsum("bhqd,hde->bqe", heads, Wp.reshape(NH, HS, D))  # (B, N, D)
