"""The ``flex`` backend (``functional.flex_backend``) against the math path.

Parity across masks runs flex_attention unfused (the same score and mask
functions, no compilation per case); one test runs the compiled kernel on
the hard cases together and checks that a second call does not compile
again. CUDA tests (forward, backward, weights) are skipped without CUDA."""

import numpy as np
import pytest
import torch
from support.attention import make_qkv
from support.paths import assert_paths_agree
from torch._dynamo.utils import counters

import multihead.functional.flex_backend as flex_backend
from multihead.functional import (
    WeightSelection,
    alibi_slopes,
    attention,
    document_mask,
    padding_mask_from_lengths,
    prefix_lm_mask,
    sliding_window_mask,
)
from multihead.functional.backends import select_backend
from multihead.functional.request import make_request

F32 = torch.float32


@pytest.fixture
def unfused(monkeypatch):
    """flex_attention without torch.compile: the same functions, no compile per case."""
    monkeypatch.setattr(flex_backend, "compiled_flex", lambda: flex_backend._flex_call)


def _masks(B, T, S):
    rng = np.random.default_rng(5)
    empty = torch.from_numpy(rng.random((B, 1, T, S)) < 0.6)
    empty[0, 0, 1] = False  # a row that sees nothing
    docs = torch.tensor([[0, 0, 1, 1, 1, 2][:T]] * B)
    return {
        "none": {},
        "causal": {"is_causal": True},
        "causal_bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
        "padding": {"attn_mask": padding_mask_from_lengths([S, 2][:B], S)},
        "empty_rows": {"attn_mask": empty},
        "per_head": {"attn_mask": torch.from_numpy(rng.random((1, 4, T, S)) < 0.5), "is_causal": True},
        "window": {"attn_mask": sliding_window_mask(T, S, window=2, alignment="bottom_right")},
        "float_bias": {"attn_mask": torch.from_numpy(rng.standard_normal((1, 4, T, S))).float()},
        "documents": {"attn_mask": document_mask(docs), "is_causal": True} if T == S else {},
        "prefix_lm": {"attn_mask": prefix_lm_mask(T, 2, S)},
    }


SHAPES = [(2, 4, 2, 6, 6), (2, 4, 1, 3, 7), (1, 4, 4, 5, 3)]  # GQA, MQA with T < S, MHA with T > S


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask", list(_masks(2, 6, 6)))
@pytest.mark.parametrize("mods", [{}, {"alibi": True, "softcap": 3.0}], ids=["plain", "alibi+softcap"])
def test_flex_equals_math_across_masks_gqa_alignments_and_score_mods(unfused, shape, mask, mods):
    B, H, G, T, S = shape
    q, k, v = make_qkv(np.random.default_rng(6), B, H, G, T, S, 8, 4, dtype=F32)
    call = dict(_masks(B, T, S)[mask])
    if mods.get("alibi"):
        call["alibi_slopes"] = alibi_slopes(H)
    call["softcap"] = mods.get("softcap")
    with torch.no_grad():
        got = attention(q * 2, k, v, backend="flex", **call)
        want = attention(q * 2, k, v, backend="math", **call)
    assert_paths_agree(got, want)


def test_nan_in_masked_out_values_does_not_leak_and_a_visible_one_shows(unfused):
    q, k, v = make_qkv(np.random.default_rng(7), 1, 2, 1, 4, 4, 8, dtype=F32)
    v[0, 0, 3] = float("nan")  # key 3: hidden from rows 0-2 by causality, seen by row 3
    with torch.no_grad():
        out = attention(q, k, v, is_causal=True, softcap=5.0, backend="flex")
        want = attention(q, k, v, is_causal=True, softcap=5.0, backend="math")
    assert torch.isfinite(out[:, :, :3]).all() and torch.isnan(out[:, :, 3]).all()
    assert_paths_agree(out, want)


def test_weights_rebuilt_from_flex_log_sum_exp_equal_math_weights(unfused):
    """The CUDA path's weights: from flex_attention's log-sum-exp (the unfused
    implementation returns one on a CPU too), with softcap, ALiBi and a bias."""
    q, k, v = make_qkv(np.random.default_rng(8), 2, 4, 2, 5, 7, 8, dtype=F32)
    call = dict(attn_mask=_masks(2, 5, 7)["empty_rows"]["attn_mask"], is_causal=True, causal_alignment="bottom_right",
                scale=None, dropout_p=0.0, training=False, return_weights=WeightSelection(heads=[1, 3], rows=[0, 4]),
                alibi_slopes=alibi_slopes(4), softcap=2.0)  # fmt: skip
    req = make_request(q * 3, k, v, **call)
    _, lse = flex_backend._flex_call(q * 3, k, v, flex_backend.block_mask_for(req), None, req.alibi_slopes,
                                     2.0, req.alibi_offset, req.scale, True, True)  # fmt: skip
    got = flex_backend.flex_weights(req, lse)
    _, want = attention(q * 3, k, v, backend="math", **{n: call[n] for n in ("attn_mask", "is_causal",
                        "causal_alignment", "return_weights", "alibi_slopes", "softcap")})  # fmt: skip
    assert_paths_agree(got, want)


def test_flex_says_why_it_cannot_serve_and_auto_never_picks_it_on_a_cpu(monkeypatch):
    q, k, v = make_qkv(np.random.default_rng(9), 1, 2, 1, 3, 3, 4, dtype=F32, requires_grad=True)

    def reasons(**kw):
        base = dict(attn_mask=None, is_causal=False, causal_alignment="top_left", scale=None, dropout_p=0.0,
                    training=False, return_weights=False, softcap=4.0)  # fmt: skip
        qkv = kw.pop("qkv", (q, k, v))
        base.update(kw)
        return flex_backend.flex_not_supported(make_request(*qkv, **base))

    assert any("inference only (no backward)" in r for r in reasons())
    assert any("no dropout" in r for r in reasons(dropout_p=0.1, training=True))
    assert any("returns no log-sum-exp" in r for r in reasons(return_weights=True))
    assert any(r.startswith("float64:") for r in reasons(qkv=tuple(t.detach().double() for t in (q, k, v))))
    with torch.no_grad():
        assert reasons() == []
        with monkeypatch.context() as patch:
            patch.setattr(torch.compiler, "is_compiling", lambda: True)
            assert any("inside torch.compile on CPU" in r for r in reasons())
    with pytest.raises(ValueError, match="backend 'flex' cannot serve this call: an input requires grad"):
        attention(q, k, v, softcap=4.0, backend="flex")
    req = make_request(q, k, v, attn_mask=None, is_causal=False, causal_alignment="top_left", scale=None,
                       dropout_p=0.0, training=False, return_weights=False, softcap=4.0)  # fmt: skip
    with torch.no_grad():
        assert select_backend("auto", req).name == "math"  # flex is taken automatically on CUDA only


def test_compiled_flex_serves_the_hard_cases_and_compiles_once_per_shape_family():
    B, H, G, T, S = 2, 4, 2, 5, 9
    q, k, v = make_qkv(np.random.default_rng(10), B, H, G, T, S, 8, dtype=F32)
    v[1, 0, 0] = float("nan")  # hidden from batch 1 by its padding
    call = dict(attn_mask=padding_mask_from_lengths([9, 6], S, left=True), is_causal=True,
                causal_alignment="bottom_right", alibi_slopes=alibi_slopes(H), softcap=4.0)  # fmt: skip
    keep = call["attn_mask"] & torch.ones(1, 1, T, S, dtype=torch.bool).index_fill(2, torch.tensor([1]), False)
    bias = torch.randn(1, H, T, S, generator=torch.Generator().manual_seed(0))
    call["attn_mask"] = bias.masked_fill(~keep, float("-inf"))  # a float bias, -inf where hidden
    with torch.no_grad():
        want = attention(q, k, v, backend="math", **call)
        got = attention(q, k, v, backend="flex", **call)
        graphs = counters["stats"]["unique_graphs"]
        again = attention(q + 1, k, v, backend="flex", **call)
    assert counters["stats"]["unique_graphs"] == graphs  # the same shape family: no new compilation
    assert torch.equal(got[:, :, 1], torch.zeros_like(got[:, :, 1]))  # rows that see nothing give 0
    assert_paths_agree(got, want)
    with torch.no_grad():
        assert_paths_agree(again, attention(q + 1, k, v, backend="math", **call))


def test_document_and_prefix_lm_masks_say_who_sees_whom():
    docs = torch.tensor([[0, 0, 1, 1, 2]])
    m = document_mask(docs)
    assert m.shape == (1, 1, 5, 5)
    for i in range(5):
        for j in range(5):
            assert bool(m[0, 0, i, j]) == (docs[0, i] == docs[0, j])
    p = prefix_lm_mask(4, 2)
    for i in range(4):
        for j in range(4):
            assert bool(p[i, j]) == (j < 2 or j <= i)
    rows = prefix_lm_mask(3, torch.tensor([0, 3]))
    assert rows.shape == (2, 1, 3, 3) and rows[1].all() and torch.equal(rows[0, 0], torch.ones(3, 3).tril().bool())
    with pytest.raises(TypeError, match="document_ids must be an integer torch.Tensor"):
        document_mask(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="prefix must be a non-negative int, got prefix=-1"):
        prefix_lm_mask(3, -1)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cuda_flex_forward_backward_and_weights_equal_math(dtype):
    B, H, G, T, S = 2, 4, 2, 64, 80
    q, k, v = (t.cuda().requires_grad_() for t in make_qkv(np.random.default_rng(11), B, H, G, T, S, 64, dtype=dtype))
    call = dict(attn_mask=padding_mask_from_lengths([80, 50], S).cuda(), is_causal=True,
                causal_alignment="bottom_right", alibi_slopes=alibi_slopes(H, device="cuda"), softcap=20.0)  # fmt: skip
    got = attention(q, k, v, backend="flex", **call)
    want = attention(q, k, v, backend="math", **call)
    g = torch.randn_like(got)
    grads = torch.autograd.grad((got * g).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * g).sum(), (q, k, v))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, **tol)
    with torch.no_grad():
        out, w = attention(q, k, v, backend="flex", return_weights=WeightSelection(heads=[1], rows=[0, 63]), **call)
        _, w_math = attention(q, k, v, backend="math", return_weights=True, **call)
    torch.testing.assert_close(w.float(), w_math[:, [1]][:, :, [0, 63]].float(), **tol)
    assert select_backend("auto", make_request(q.detach(), k.detach(), v.detach(), attn_mask=None, is_causal=False,
                          causal_alignment="top_left", scale=None, dropout_p=0.0, training=False,
                          return_weights=False, softcap=20.0)).name == "flex"  # fmt: skip


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("D", [8, 16])
def test_cuda_auto_takes_flex_for_softcap_from_head_width_16_in_float32_and_equals_math(dtype, D):
    """Softcap under auto on CUDA, T != S, bottom-right: flex from width 16 in float32, math below and
    in float64 (seen on an H100: torch's CUDA flex kernel refuses widths under 16, and Triton failed
    to compile its float64 form)."""
    q, k, v = (t.cuda() for t in make_qkv(np.random.default_rng(12), 2, 4, 2, 3, 9, D, dtype=dtype))
    call = dict(is_causal=True, causal_alignment="bottom_right", softcap=5.0, alibi_slopes=alibi_slopes(4, device="cuda"))
    req = make_request(q, k, v, attn_mask=None, is_causal=True, causal_alignment="bottom_right", scale=None,
                       dropout_p=0.0, training=False, return_weights=False, softcap=5.0)  # fmt: skip
    assert select_backend("auto", req).name == ("flex" if D >= 16 and dtype == torch.float32 else "math")
    if D < 16:
        assert any("below 16 on CUDA" in r for r in flex_backend.flex_not_supported(req))
    with torch.no_grad():
        torch.testing.assert_close(attention(q, k, v, **call), attention(q, k, v, backend="math", **call),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip
