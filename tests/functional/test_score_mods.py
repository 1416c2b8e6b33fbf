"""ALiBi and logit soft-capping as request fields: the math path against an
independent float64 formula, sdpa serving ALiBi as an added bias (with exact
weights from its log-sum-exp) and refusing soft-capping."""

import math

import numpy as np
import pytest
import torch
from support.attention import F64, assert_matches, make_qkv
from support.paths import assert_paths_agree

from multihead.functional import WeightSelection, alibi_slopes, attention, padding_mask_from_lengths
from multihead.functional.backends import select_backend
from multihead.functional.request import make_request


def reference(q, k, v, *, slopes=None, softcap=None, allowed=None, causal=False, alignment="top_left"):
    """float64 softmax(cap(q k^T / sqrt(D)) - m_h |i + offset - j|) v over visible keys; empty rows 0."""
    B, H, T, D = q.shape
    G, S = k.shape[1], k.shape[2]
    k = k.double().repeat_interleave(H // G, dim=1)
    v = v.double().repeat_interleave(H // G, dim=1)
    x = q.double() @ k.transpose(-1, -2) / math.sqrt(D)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    offset = 0 if alignment == "top_left" else S - T
    i = np.arange(T)[:, None] + offset
    j = np.arange(S)[None, :]
    if slopes is not None:
        dist = torch.from_numpy(np.abs(i - j).astype(np.float64))
        x = x - slopes.double()[:, None, None] * dist
    ok = torch.ones(B, H, T, S, dtype=torch.bool)
    if allowed is not None:
        ok = ok & allowed
    if causal:
        ok = ok & torch.from_numpy(j <= i)
    x = x.masked_fill(~ok, -math.inf)
    w = torch.softmax(x, dim=-1).nan_to_num(0.0)
    return w @ v, w


CASES = [  # (B, H, G, T, S, causal, alignment, padded)
    (2, 4, 2, 5, 5, True, "top_left", False),
    (2, 4, 1, 3, 7, True, "bottom_right", True),
    (1, 6, 3, 7, 4, True, "bottom_right", False),  # T > S: the first rows see nothing
    (2, 3, 3, 4, 6, False, "bottom_right", True),
    (2, 4, 4, 6, 3, True, "top_left", True),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("mods", ["alibi", "softcap", "both"])
def test_math_path_applies_alibi_and_softcap_as_the_formula_says(case, mods):
    B, H, G, T, S, causal, alignment, padded = case
    q, k, v = make_qkv(np.random.default_rng(0), B, H, G, T, S, 8, 5)
    q = q * 3  # large scores, so the cap matters
    slopes = alibi_slopes(H, dtype=F64) if mods != "softcap" else None
    cap = 2.5 if mods != "alibi" else None
    mask = padding_mask_from_lengths([S - 1, 2][:B], S) if padded else None
    want_out, want_w = reference(q, k, v, slopes=slopes, softcap=cap, allowed=mask, causal=causal, alignment=alignment)
    out, w = attention(q, k, v, attn_mask=mask, is_causal=causal, causal_alignment=alignment, alibi_slopes=slopes,
                       softcap=cap, backend="math", return_weights=True)  # fmt: skip
    assert_matches(out, want_out)
    assert_matches(w, want_w)


@pytest.mark.parametrize("case", CASES)
def test_sdpa_serves_alibi_as_a_bias_with_exact_weights_from_its_log_sum_exp(case):
    B, H, G, T, S, causal, alignment, padded = case
    q, k, v = make_qkv(np.random.default_rng(1), B, H, G, T, S, 8)
    slopes = alibi_slopes(H, dtype=F64)
    mask = padding_mask_from_lengths([S - 1, 2][:B], S) if padded else None
    call = dict(attn_mask=mask, is_causal=causal, causal_alignment=alignment, alibi_slopes=slopes)
    want_out, want_w = reference(q, k, v, slopes=slopes, allowed=mask, causal=causal, alignment=alignment)
    assert_matches(attention(q, k, v, backend="sdpa", **call), want_out)
    out, w = attention(q, k, v, backend="sdpa", return_weights=WeightSelection(heads=[0, H - 1]), **call)
    assert_matches(out, want_out)
    assert_matches(w, want_w[:, [0, H - 1]])


def test_sdpa_refuses_softcap_and_auto_takes_math_on_a_cpu():
    q, k, v = make_qkv(np.random.default_rng(2), 1, 2, 2, 3, 3, 4)
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot serve this call: softcap=30.0: .*cannot cap"):
        attention(q, k, v, softcap=30.0, backend="sdpa")
    req = make_request(q, k, v, attn_mask=None, is_causal=False, causal_alignment="top_left", scale=None,
                       dropout_p=0.0, training=False, return_weights=False, softcap=30.0)  # fmt: skip
    assert select_backend("auto", req).name == "math"
    assert_paths_agree(attention(q, k, v, softcap=30.0), attention(q, k, v, softcap=30.0, backend="math"))


def test_float32_sdpa_with_alibi_agrees_with_math():
    q, k, v = make_qkv(np.random.default_rng(3), 2, 4, 2, 6, 6, 8, dtype=torch.float32)
    slopes = alibi_slopes(4)
    a = attention(q, k, v, is_causal=True, alibi_slopes=slopes, backend="sdpa")
    b = attention(q, k, v, is_causal=True, alibi_slopes=slopes, backend="math")
    assert_paths_agree(a, b)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes must have shape \(H,\) = \(2,\), got \(3,\)"),
        ({"alibi_slopes": [0.5, 0.25]}, TypeError, "alibi_slopes must be a floating torch.Tensor"),
        ({"softcap": 0.0}, ValueError, "softcap must be a positive finite float or None, got 0.0"),
        ({"softcap": float("inf")}, ValueError, "softcap must be a positive finite float or None, got inf"),
    ],
)
def test_bad_alibi_slopes_and_softcap_are_one_line_errors(kwargs, error, match):
    q, k, v = make_qkv(np.random.default_rng(4), 1, 2, 1, 3, 3, 4)
    with pytest.raises(error, match=match):
        attention(q, k, v, **kwargs)
