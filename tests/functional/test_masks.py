"""Mask builders in ``multihead.functional.masks`` (True = may attend)."""

import itertools
import re

import pytest
import torch

from multihead.functional import (
    causal_mask,
    merge_masks,
    padding_mask_from_ignore,
    padding_mask_from_keep,
    padding_mask_from_lengths,
    sliding_window_mask,
)
from multihead.functional.masks import check_alignment
from multihead.reference import causal_mask as ref_causal_mask

SIZES = [(0, 0), (1, 1), (1, 5), (5, 1), (4, 4), (3, 7), (7, 3)]


# ---------------------------------------------------------------- causal


@pytest.mark.parametrize(("T", "S"), SIZES)
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_mask_matches_reference_and_loop(T, S, alignment):
    m = causal_mask(T, S, alignment=alignment)
    assert m.shape == (T, S) and m.dtype == torch.bool
    assert torch.equal(m, torch.from_numpy(ref_causal_mask(T, S, alignment)))
    offset = 0 if alignment == "top_left" else S - T
    for i, j in itertools.product(range(T), range(S)):
        assert bool(m[i, j]) == (j <= i + offset)


def test_causal_mask_pictures():
    """The T = 2, S = 4 pictures of the module docstring."""
    tl = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    br = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(causal_mask(2, 4), tl)
    assert torch.equal(causal_mask(2, 4, alignment="bottom_right"), br)
    assert torch.equal(causal_mask(3), torch.ones(3, 3, dtype=torch.bool).tril())
    # bottom_right with T > S: the first T - S rows see nothing.
    m = causal_mask(5, 2, alignment="bottom_right")
    assert not bool(m[:3].any()) and bool(m[-1].all())


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
def test_causal_mask_bad_lengths(bad):
    error = ValueError if bad == -1 and not isinstance(bad, bool) else TypeError
    with pytest.raises(error, match=r"T must be a non-negative int, got T=" + re.escape(repr(bad))):
        causal_mask(bad, 3)
    if bad is not None:  # S=None means S = T
        with pytest.raises(error, match=r"S must be a non-negative int, got S="):
            causal_mask(3, bad)


def test_bad_alignment_lists_valid_ones():
    for fn in (lambda: causal_mask(2, 3, alignment="left"),
               lambda: sliding_window_mask(2, 3, window=2, alignment="left"),
               lambda: check_alignment("top-left")):
        with pytest.raises(ValueError, match=r"one of \('top_left', 'bottom_right'\)"):
            fn()
    assert check_alignment("bottom_right") == "bottom_right"


# -------------------------------------------------------- sliding window


@pytest.mark.parametrize(("T", "S"), SIZES + [(9, 9), (4, 11)])
@pytest.mark.parametrize("window", [1, 2, 3, 100])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_sliding_window_against_loop(T, S, window, alignment):
    m = sliding_window_mask(T, S, window=window, alignment=alignment)
    assert m.shape == (T, S) and m.dtype == torch.bool
    offset = 0 if alignment == "top_left" else S - T
    want = torch.zeros(T, S, dtype=torch.bool)
    for i in range(T):
        p = i + offset
        for j in range(S):
            want[i, j] = p - window < j <= p
    assert torch.equal(m, want)
    # Always a subset of the causal mask; equal to it once the window is wide.
    c = causal_mask(T, S, alignment=alignment)
    assert not bool((m & ~c).any())
    if window >= S + T:
        assert torch.equal(m, c)


def test_sliding_window_default_s_and_diagonal():
    assert torch.equal(sliding_window_mask(4, window=1), torch.eye(4, dtype=torch.bool))
    assert torch.equal(sliding_window_mask(5, window=2).sum(-1), torch.tensor([1, 2, 2, 2, 2]))


@pytest.mark.parametrize("window", [0, -3, 2.0, True, None, "2"])
def test_sliding_window_bad_window(window):
    with pytest.raises(ValueError, match=r"window must be an int >= 1, got " + repr(window).replace(".", r"\.")):
        sliding_window_mask(4, 4, window=window)


def test_sliding_window_bad_lengths():
    with pytest.raises(ValueError, match="T must be a non-negative int, got T=-2"):
        sliding_window_mask(-2, 3, window=2)
    with pytest.raises(ValueError, match="S must be a non-negative int, got S=-1"):
        sliding_window_mask(2, -1, window=2)


# ------------------------------------------------------------- padding


@pytest.mark.parametrize("left", [False, True])
def test_padding_from_lengths(left):
    lengths = [0, 1, 3, 5]
    m = padding_mask_from_lengths(lengths, 5, left=left)
    assert m.shape == (4, 1, 1, 5) and m.dtype == torch.bool
    for b, n in enumerate(lengths):
        row = m[b, 0, 0]
        assert int(row.sum()) == n
        want = [j >= 5 - n for j in range(5)] if left else [j < n for j in range(5)]
        assert row.tolist() == want
    assert torch.equal(padding_mask_from_lengths(torch.tensor(lengths), 5, left=left), m)


def test_padding_from_lengths_pictures():
    assert padding_mask_from_lengths([2], 4)[0, 0, 0].tolist() == [True, True, False, False]
    assert padding_mask_from_lengths([2], 4, left=True)[0, 0, 0].tolist() == [False, False, True, True]
    assert padding_mask_from_lengths([], 3).shape == (0, 1, 1, 3)
    assert padding_mask_from_lengths([0, 0], 0).shape == (2, 1, 1, 0)


@pytest.mark.parametrize(("lengths", "S", "match"), [
    ([3, -1], 4, r"lengths must lie in \[0, 4\], got \[3, -1\]"),
    ([5], 4, r"lengths must lie in \[0, 4\], got \[5\]"),
    ([[1, 2]], 4, r"lengths must be a 1-D integer tensor, got shape \(1, 2\)"),
    (3, 4, r"lengths must be a 1-D integer tensor, got shape \(\)"),
    ([1.0, 2.0], 4, r"1-D integer tensor.*dtype torch.float32"),
    ([True, False], 4, r"1-D integer tensor.*dtype torch.bool"),
    ([1], -1, r"S must be a non-negative int, got S=-1"),
])
def test_padding_from_lengths_errors(lengths, S, match):
    with pytest.raises(ValueError, match=match):
        padding_mask_from_lengths(lengths, S)


def test_padding_keep_vs_ignore_polarity():
    keep = torch.tensor([[True, True, False], [False, True, True]])
    a = padding_mask_from_keep(keep)
    b = padding_mask_from_ignore(~keep)
    assert a.shape == b.shape == (2, 1, 1, 3)
    assert torch.equal(a, b)
    assert torch.equal(a[:, 0, 0], keep)
    assert torch.equal(padding_mask_from_ignore(keep)[:, 0, 0], ~keep)
    assert torch.equal(padding_mask_from_keep(torch.tensor([[True, True, False]])),
                       padding_mask_from_lengths([2], 3))


@pytest.mark.parametrize("fn", [padding_mask_from_keep, padding_mask_from_ignore])
def test_padding_keep_ignore_errors(fn):
    name = "keep" if fn is padding_mask_from_keep else "ignore"
    with pytest.raises(TypeError, match=rf"{name} must be a bool tensor, got dtype torch.int64"):
        fn(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match=rf"{name} must be a bool tensor, got dtype torch.float32"):
        fn(torch.ones(2, 3))
    with pytest.raises(TypeError, match=rf"{name} must be a torch.Tensor, got list"):
        fn([[True]])
    with pytest.raises(ValueError, match=rf"{name} must have shape \(B, S\), got \(2, 1, 3\)"):
        fn(torch.ones(2, 1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"{name} must have shape \(B, S\), got \(3,\)"):
        fn(torch.ones(3, dtype=torch.bool))


# ---------------------------------------------------------------- merge


def test_merge_none():
    m = torch.ones(2, 3, dtype=torch.bool)
    assert merge_masks(None, None) is None
    assert merge_masks(m, None) is m and merge_masks(None, m) is m


def test_merge_bool_and_bool_is_and_with_broadcast():
    pad = padding_mask_from_lengths([3, 1], 4)  # (2, 1, 1, 4)
    c = causal_mask(3, 4)
    m = merge_masks(pad, c)
    assert m.shape == (2, 1, 3, 4) and m.dtype == torch.bool
    assert torch.equal(m, pad & c)
    assert torch.equal(merge_masks(c, pad), m)


@pytest.mark.parametrize("order", ["bool_first", "float_first"])
def test_merge_bool_and_float(order):
    keep = torch.tensor([[True, False, True]])
    bias = torch.tensor([[0.5, 1.0, -2.0]], dtype=torch.float64)
    m = merge_masks(keep, bias) if order == "bool_first" else merge_masks(bias, keep)
    assert m.dtype == torch.float64
    assert m.tolist() == [[0.5, float("-inf"), -2.0]]


def test_merge_float_and_float_adds_and_overflow_means_hidden():
    lo = torch.finfo(torch.float32).min
    a = torch.tensor([[0.0, lo, lo, 1.0]])
    b = torch.tensor([[lo, lo, 0.0, 2.0]])
    m = merge_masks(a, b)
    assert m.dtype == torch.float32
    assert m[0, 0] == lo and m[0, 2] == lo and m[0, 3] == 3.0
    assert bool(torch.isneginf(m[0, 1]))  # two finfo.min planes: hidden, read as -inf


def test_builders_on_a_device_argument():
    assert causal_mask(2, 3, device="meta").device.type == "meta"
    assert sliding_window_mask(2, 3, window=2, device="cpu").device.type == "cpu"


def test_padding_from_lengths_non_int_length_is_a_type_error():
    with pytest.raises(TypeError, match=r"S must be a non-negative int, got S=2\.5"):
        padding_mask_from_lengths([1], 2.5)
