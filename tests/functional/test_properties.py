"""Hypothesis properties of ``multihead.functional.attention`` (float64, both
backends): permutation equivariance, causality, masked-value invariance,
GQA = MHA for expanded heads, and typed errors for every invalid input."""


import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.attention import BACKENDS, F64, assert_matches, check_against_reference, make_qkv
from support.properties import examples

from multihead.functional import attention, padding_mask_from_lengths

SETTINGS = settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOL = 1e-12

backends = st.sampled_from(BACKENDS)
seeds = st.integers(0, 2**32 - 1)


@st.composite
def dims(draw, min_t=1, min_s=1):
    """(B, H, G, T, S, D, Dv) with G dividing H."""
    H = draw(st.sampled_from([1, 2, 3, 4, 6]))
    G = draw(st.sampled_from([g for g in range(1, H + 1) if H % g == 0]))
    return (draw(st.integers(1, 3)), H, G, draw(st.integers(min_t, 9)), draw(st.integers(min_s, 9)),
            draw(st.integers(1, 8)), draw(st.integers(1, 5)))


@SETTINGS
@given(shape=dims(), backend=backends, seed=seeds, data=st.data())
def test_key_value_permutation_invariance(shape, backend, seed, data):
    """Without a mask, permuting keys and values together changes nothing."""
    B, H, G, T, S, D, Dv = shape
    q, k, v = make_qkv(np.random.default_rng(seed), *shape)
    perm = torch.tensor(data.draw(st.permutations(range(S))))
    out = attention(q, k, v, backend=backend)
    assert_matches(attention(q, k[:, :, perm], v[:, :, perm], backend=backend), out, TOL)


@SETTINGS
@given(shape=dims(), backend=backends, seed=seeds, data=st.data())
def test_query_permutation_equivariance(shape, backend, seed, data):
    """Permuting queries permutes the outputs (and weights) the same way."""
    B, H, G, T, S, D, Dv = shape
    q, k, v = make_qkv(np.random.default_rng(seed), *shape)
    perm = torch.tensor(data.draw(st.permutations(range(T))))
    out = attention(q, k, v, backend=backend)
    assert_matches(attention(q[:, :, perm], k, v, backend=backend), out[:, :, perm], TOL)
    # A query-dependent mask permutes with the queries.
    mask = torch.from_numpy(np.random.default_rng(seed + 1).random((B, 1, T, S)) < 0.6)
    out_m = attention(q, k, v, attn_mask=mask, backend=backend)
    assert_matches(attention(q[:, :, perm], k, v, attn_mask=mask[:, :, perm], backend=backend),
                   out_m[:, :, perm], TOL)


@SETTINGS
@given(shape=dims(), backend=backends, seed=seeds, causal=st.booleans(), data=st.data())
def test_head_permutation_equivariance(shape, backend, seed, causal, data):
    """Permuting the key/value groups, with their blocks of R query heads,
    permutes the output heads the same way."""
    B, H, G, T, S, D, Dv = shape
    q, k, v = make_qkv(np.random.default_rng(seed), *shape)
    R = H // G
    gperm = torch.tensor(data.draw(st.permutations(range(G))))
    hperm = (gperm[:, None] * R + torch.arange(R)).reshape(-1)  # (G, R) -> (H,)
    out = attention(q, k, v, is_causal=causal, backend=backend)
    got = attention(q[:, hperm], k[:, gperm], v[:, gperm], is_causal=causal, backend=backend)
    assert_matches(got, out[:, hperm], TOL)


@SETTINGS
@given(shape=dims(), extra=st.integers(1, 6), backend=backends, seed=seeds)
def test_causality_appending_tokens(shape, extra, backend, seed):
    """top_left causal (self-attention, S = T): appending tokens leaves the
    outputs of the earlier tokens unchanged."""
    B, H, G, T, _, D, Dv = shape
    q, k, v = make_qkv(np.random.default_rng(seed), B, H, G, T + extra, T + extra, D, Dv)
    full = attention(q, k, v, is_causal=True, backend=backend)
    prefix = attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], is_causal=True, backend=backend)
    assert_matches(full[:, :, :T], prefix, TOL)


@SETTINGS
@given(shape=dims(), extra=st.integers(1, 6), backend=backends, seed=seeds)
def test_causality_bottom_right_decoding(shape, extra, backend, seed):
    """bottom_right: the last T queries over S keys equal the last T rows of
    the full top_left self-attention (decoding with a cache)."""
    B, H, G, T, _, D, Dv = shape
    S = T + extra
    q, k, v = make_qkv(np.random.default_rng(seed), B, H, G, S, S, D, Dv)
    full = attention(q, k, v, is_causal=True, backend=backend)
    last = attention(q[:, :, -T:], k, v, is_causal=True, causal_alignment="bottom_right", backend=backend)
    assert_matches(last, full[:, :, -T:], TOL)


@SETTINGS
@given(shape=dims(), backend=backends, seed=seeds,
       poison=st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e30, 0.0]),
       causal=st.booleans())
def test_masked_value_invariance(shape, backend, seed, poison, causal):
    """Whatever sits at keys/values a query may not see leaves it unchanged."""
    B, H, G, T, S, D, Dv = shape
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv(rng, *shape)
    keep = padding_mask_from_lengths(torch.from_numpy(rng.integers(0, S + 1, size=B)), S,
                                     left=bool(rng.integers(2)))
    hidden = (~keep[:, 0, 0])[:, None, :, None]  # (B, 1, S, 1)
    k2 = k.masked_fill(hidden, poison)
    v2 = v.masked_fill(hidden, poison)
    out = attention(q, k, v, attn_mask=keep, is_causal=causal, backend=backend)
    got = attention(q, k2, v2, attn_mask=keep, is_causal=causal, backend=backend)
    assert bool(torch.isfinite(got).all())
    assert_matches(got, out, TOL)


@SETTINGS
@given(shape=dims(), backend=backends, seed=seeds, causal=st.booleans(),
       align=st.sampled_from(["top_left", "bottom_right"]))
def test_gqa_equals_mha_with_expanded_heads(shape, backend, seed, causal, align):
    B, H, G, T, S, D, Dv = shape
    q, k, v = make_qkv(np.random.default_rng(seed), *shape)
    R = H // G
    kw = {"is_causal": causal, "causal_alignment": align, "backend": backend}
    got = attention(q, k, v, **kw)
    want = attention(q, k.repeat_interleave(R, 1), v.repeat_interleave(R, 1), **kw)
    assert_matches(got, want, TOL)
    # Each group of R query heads alone is MHA with one key/value head.
    for g in range(G):
        head = attention(q[:, g * R:(g + 1) * R], k[:, g:g + 1], v[:, g:g + 1], **kw)
        assert_matches(got[:, g * R:(g + 1) * R], head, TOL)


# ------------------------------------------------------ invalid inputs


def _valid(qs, ks, vs, dtypes, ms, mdtype, p, scale, align) -> bool:
    """Whether the call is valid by the documented rules (RELIABILITY.md)."""
    if not all(d.is_floating_point for d in dtypes[:3]) or len(set(dtypes[:3])) != 1:
        return False
    if not (len(qs) == len(ks) == len(vs) == 4):
        return False
    B, H, T, D = qs
    _, G, S, _ = ks
    if ks[0] != B or vs[0] != B or vs[1] != G or vs[2] != S or ks[3] != D:
        return False
    if G < 1 or G > H or H % G:
        return False
    if ms is not None:
        if mdtype != torch.bool and not mdtype.is_floating_point:
            return False
        if len(ms) == 2:
            if ms != (T, S):
                return False
        elif len(ms) == 4:
            if any(m not in (1, w) for m, w in zip(ms, (B, H, T, S))):
                return False
        else:
            return False
    if isinstance(p, bool) or not (0.0 <= p < 1.0):
        return False
    if scale is not None and (isinstance(scale, bool) or not np.isfinite(scale)):
        return False
    return align in ("top_left", "bottom_right")


small = st.integers(0, 4)
shape4 = st.tuples(small, small, small, small)
any_shape = st.one_of(shape4, st.lists(small, min_size=0, max_size=5).map(tuple))
dtypes = st.sampled_from([F64, F64, F64, torch.float32, torch.int64, torch.bool])
mask_dtypes = st.sampled_from([torch.bool, F64, torch.float32, torch.int32, torch.uint8])


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.tuples(st.integers(0, 3), st.sampled_from([1, 2, 4]), st.integers(0, 4), st.integers(0, 4),
                   st.integers(0, 4), st.integers(0, 4)),
    mutate=st.sampled_from(["none", "q", "k", "v", "dtype", "mask"]),
    q_any=any_shape, k_any=any_shape, v_any=any_shape,
    dts=st.tuples(dtypes, dtypes, dtypes), mdtype=mask_dtypes,
    mask_kind=st.sampled_from(["none", "ts", "4d", "any"]), m_any=any_shape,
    p=st.sampled_from([0.0, 0.1, 0.99, 1.0, -0.5, float("nan"), True]),
    scale=st.sampled_from([None, 0.5, 0.0, -2.0, float("inf"), float("nan"), True]),
    align=st.sampled_from(["top_left", "bottom_right", "top-left"]),
    causal=st.booleans(), backend=st.sampled_from(["auto", *BACKENDS]), weights=st.booleans(),
)
def test_invalid_inputs_raise_typed_errors(base, mutate, q_any, k_any, v_any, dts, mdtype, mask_kind,
                                           m_any, p, scale, align, causal, backend, weights):
    """Valid calls succeed; invalid ones raise ValueError/TypeError, nothing else."""
    B, H, T, S, D, Dv = base
    G = max(1, H // 2)
    qs, ks, vs = (B, H, T, D), (B, G, S, D), (B, G, S, Dv)
    if mutate == "q":
        qs = q_any
    elif mutate == "k":
        ks = k_any
    elif mutate == "v":
        vs = v_any
    dt = dts if mutate == "dtype" else (F64, F64, F64)
    q, k, v = (torch.zeros(s, dtype=d) for s, d in zip((qs, ks, vs), dt))
    ms = {"none": None, "ts": (T, S), "4d": (1, H, T, 1), "any": m_any}[mask_kind]
    if mutate == "mask" and ms is not None:
        ms = m_any
    mask = None if ms is None else torch.zeros(ms, dtype=mdtype)
    valid = _valid(qs, ks, vs, dt, ms, mdtype, p, scale, align)
    # sdpa rebuilds weights from its kernel's log-sum-exp, which has no dropout (training=True below)
    valid = valid and not (backend == "sdpa" and weights and not isinstance(p, bool) and p > 0)
    try:
        res = attention(q, k, v, attn_mask=mask, is_causal=causal, causal_alignment=align, scale=scale,
                        dropout_p=p, training=True, return_weights=weights, backend=backend)
    except (ValueError, TypeError):
        assert not valid, "a valid call raised"
        return
    assert valid, "an invalid call was accepted"
    out = res[0] if weights else res
    assert out.shape == (qs[0], qs[1], qs[2], vs[3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_typed_errors_for_non_tensor_arguments(backend):
    q = torch.zeros(1, 1, 2, 2, dtype=F64)
    for bad in ([1.0], np.zeros((1, 1, 2, 2)), "q"):
        with pytest.raises(TypeError):
            attention(bad, q, q, backend=backend)
        with pytest.raises(TypeError):
            attention(q, q, q, attn_mask=bad, backend=backend)


# ------------------------------------------------- random calls vs reference


@st.composite
def calls(draw):
    """A random valid call: shape, a mask of any accepted layout, causality,
    and up to two NaN entries in q, k, v or a float mask."""
    B, H, G, T, S, D, Dv = draw(dims(min_t=0, min_s=0))
    Dv = draw(st.sampled_from([Dv, Dv, 0]))
    rng = np.random.default_rng(draw(seeds))
    kind = draw(st.sampled_from(["none", "2d", "4d"]))
    mask = None
    if kind != "none":
        shape = (T, S) if kind == "2d" else tuple(
            n if draw(st.booleans()) else 1 for n in (B, H, T, S))
        if draw(st.booleans()):
            mask = torch.from_numpy(rng.random(shape) < draw(st.sampled_from([0.0, 0.3, 0.8, 1.0])))
        else:
            mask = torch.from_numpy(rng.standard_normal(shape))
            mask = mask.masked_fill(torch.from_numpy(rng.random(shape) < 0.3), float("-inf"))
    kw = {"attn_mask": mask, "is_causal": draw(st.booleans()),
          "causal_alignment": draw(st.sampled_from(["top_left", "bottom_right"])),
          "scale": draw(st.sampled_from([None, 0.3, 1.7]))}
    q, k, v = make_qkv(rng, B, H, G, T, S, D, Dv)
    n_nan = draw(st.integers(0, 2))
    for _ in range(n_nan):  # NaN at a random spot of q, k or v
        float_mask = [mask] if mask is not None and mask.dtype != torch.bool else []
        x = draw(st.sampled_from([q, k, v, *float_mask]))
        if x.numel():
            x.view(-1)[int(rng.integers(x.numel()))] = float("nan")
    return q, k, v, kw


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=calls(), backend=backends)
def test_random_calls_match_reference(call, backend):
    """Any valid call (masks of every accepted layout, empty tensors, NaN in
    inputs) matches the float64 reference, NaN pattern included."""
    q, k, v, kw = call
    mask = kw.pop("attn_mask")
    check_against_reference(q, k, v, backend, attn_mask=mask, **kw)
