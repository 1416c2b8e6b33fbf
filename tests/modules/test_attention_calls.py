"""MultiHeadAttention call-time rows of docs RELIABILITY.md: validation
(typed errors naming the shapes) and defined outputs (empty inputs, fully
padded rows, non-finite masked inputs, strided inputs, B == T == H)."""

from __future__ import annotations

import re

import pytest
import torch
from support.modules import random_module as _module

from multihead.modules.registry import attention_class, build_attention, list_attention_kinds

F64 = torch.float64
BACKENDS = ["math", "sdpa"]






def _shape(t) -> str:
    return re.escape(str(tuple(t)))


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("shape", [(3, 8), (2, 3, 4, 8), (8,), (2, 3, 7), (2, 3, 9)])
def test_query_of_wrong_rank_or_width_names_its_shape(shape):
    m = _module(embed_dim=8, num_heads=2)
    with pytest.raises(ValueError, match=r"query must be \(B, T, 8\), got " + _shape(shape)):
        m(torch.randn(*shape, dtype=F64))


@pytest.mark.parametrize("shape", [(4, 5), (2, 4, 5, 1), (2, 4, 8)])
def test_key_of_wrong_rank_or_width_names_its_shape(shape):
    m = _module(embed_dim=8, num_heads=2, kdim=5, vdim=6)
    with pytest.raises(ValueError, match=r"key must be \(B, T, 5\), got " + _shape(shape)):
        m(torch.randn(2, 3, 8, dtype=F64), torch.randn(*shape, dtype=F64), torch.randn(2, 4, 6, dtype=F64))


def test_value_of_wrong_width_names_its_shape():
    m = _module(embed_dim=8, num_heads=2, kdim=5, vdim=6)
    with pytest.raises(ValueError, match=r"value must be \(B, T, 6\), got \(2, 4, 5\)"):
        m(torch.randn(2, 3, 8, dtype=F64), torch.randn(2, 4, 5, dtype=F64), torch.randn(2, 4, 5, dtype=F64))


@pytest.mark.parametrize("which", ["key", "value"])
def test_mismatched_batch_names_both_shapes(which):
    m = _module(embed_dim=8, num_heads=2)
    x = torch.randn(2, 3, 8, dtype=F64)
    key = torch.randn(3 if which == "key" else 2, 4, 8, dtype=F64)
    value = torch.randn(3 if which == "value" else 2, 4, 8, dtype=F64)
    bad = key if which == "key" else value
    with pytest.raises(ValueError, match=rf"query=\(2, 3, 8\), {which}={_shape(bad.shape)}"):
        m(x, key, value)


def test_key_and_value_lengths_differ_names_both_shapes():
    m = _module(embed_dim=8, num_heads=2)
    x = torch.randn(2, 3, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"key and value lengths differ: key=\(2, 4, 8\), value=\(2, 5, 8\)"):
        m(x, torch.randn(2, 4, 8, dtype=F64), torch.randn(2, 5, 8, dtype=F64))


def test_value_without_key_and_non_tensors():
    m = _module(embed_dim=8, num_heads=2)
    x = torch.randn(2, 3, 8, dtype=F64)
    with pytest.raises(ValueError, match="value given without key"):
        m(x, None, x)
    with pytest.raises(TypeError, match="query must be a torch.Tensor, got list"):
        m([[1.0] * 8])
    with pytest.raises(TypeError, match="key must be a torch.Tensor, got ndarray"):
        m(x, x.numpy())


def test_dtypes_that_differ_raise_value_error_naming_them():
    m = _module(embed_dim=8, num_heads=2)
    x = torch.randn(2, 3, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"query torch.float64 on cpu, key torch.float32"):
        m(x, x.float())
    with pytest.raises(ValueError, match=r"query torch.float64 on cpu, value torch.float32"):
        m(x, x, x.float())


@pytest.mark.parametrize("shape", [(2, 4), (3, 5), (5,), (2, 1, 1, 5), (1, 5)])
def test_key_mask_of_wrong_shape(shape):
    m = _module(embed_dim=8, num_heads=2)
    x, key = torch.randn(2, 3, 8, dtype=F64), torch.randn(2, 5, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"key_mask must be \(B, S\) = \(2, 5\), got " + _shape(shape)):
        m(x, key, key_mask=torch.ones(shape, dtype=torch.bool))


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_torchs_key_padding_mask_is_refused_naming_key_mask_and_the_polarity(kind):
    """A PyTorch user's key_padding_mask (True = ignore) would silently mean the opposite here."""
    options = attention_class(kind).comparison_options(kind, 2)
    m = build_attention(kind, embed_dim=8, num_heads=2, **options).double()
    x = torch.randn(2, 3, 8, dtype=F64)
    pad = torch.tensor([[False, False, True], [False, False, False]])
    with pytest.raises(TypeError, match=r"take key_mask \(True = may attend.*not torch's key_padding_mask \(True = padding"):
        m(x, key_padding_mask=pad)
    m(x, key_mask=~pad)  # what the message says to pass


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_masks_raise_type_error(dtype):
    m = _module(embed_dim=8, num_heads=2)
    x = torch.randn(2, 3, 8, dtype=F64)
    with pytest.raises(TypeError, match=rf"key_mask must be bool or floating, got dtype {dtype}"):
        m(x, key_mask=torch.ones(2, 3, dtype=dtype))
    with pytest.raises(TypeError, match="attn_mask must be bool .* or floating"):
        m(x, attn_mask=torch.ones(3, 3, dtype=dtype))
    with pytest.raises(TypeError, match="key_mask must be a torch.Tensor"):
        m(x, key_mask=[[True] * 3] * 2)


@pytest.mark.parametrize("shape", [(4, 5), (3, 4), (2, 5), (2, 3, 5), (2, 3, 3, 5), (1, 2, 3, 5, 1)])
def test_attn_mask_of_wrong_shape_lists_accepted_shapes(shape):
    m = _module(embed_dim=8, num_heads=2)
    x, key = torch.randn(2, 3, 8, dtype=F64), torch.randn(2, 5, 8, dtype=F64)
    with pytest.raises(ValueError, match=r"accepted: \(T, S\) = \(3, 5\) or 4-D broadcastable to "
                                         r"\(B, H, T, S\) = \(2, 2, 3, 5\)"):
        m(x, key, attn_mask=torch.ones(shape, dtype=torch.bool))


def test_unknown_backend_and_alignment():
    m = _module(embed_dim=8, num_heads=2)
    x = torch.randn(2, 3, 8, dtype=F64)
    with pytest.raises(ValueError, match="unknown backend 'flash'"):
        m(x, backend="flash")
    with pytest.raises(ValueError, match="causal_alignment must be one of"):
        m(x, is_causal=True, causal_alignment="diagonal")
    with pytest.raises(ValueError, match="backend 'sdpa' cannot serve this call: return_weights"):
        m(x, return_weights=True, backend="sdpa")


# ---------------------------------------------------------------- semantics
@pytest.mark.parametrize("backend", BACKENDS)
def test_bool_mask_with_is_causal_combines_by_and(backend):
    m = _module(embed_dim=8, num_heads=2)
    x = torch.randn(2, 5, 8, dtype=F64)
    mask = torch.rand(5, 5) > 0.4
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    got = m(x, attn_mask=mask, is_causal=True, backend=backend)
    torch.testing.assert_close(got, m(x, attn_mask=mask & causal, backend="math"), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_and_attention_masks_combine_without_overflow(backend):
    """Two finfo.min planes must not add up to -inf (transformers#27114): the
    masks combine by AND, so a row hidden by both still gives zeros, not NaN,
    and a row hidden by one of them equals the row hidden by that one alone."""
    m = _module(embed_dim=8, num_heads=2)
    x = torch.randn(2, 4, 8, dtype=F64)
    lo = torch.finfo(F64).min
    kpm = torch.zeros(2, 4, dtype=F64)
    kpm[1, 2:] = lo
    attn = torch.zeros(4, 4, dtype=F64)
    attn[:, 3] = lo
    got = m(x, attn_mask=attn, key_mask=kpm, backend=backend)
    assert torch.isfinite(got).all()
    keep = torch.tensor([[True, True, True, False], [True, True, False, False]])
    torch.testing.assert_close(got, m(x, key_mask=keep, backend=backend), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_b_equals_t_equals_h_padding_mask_is_per_batch(backend):
    """A (B, S) padding mask must not be read as a (T, S) mask when B == T == H."""
    B = T = H = 4
    m = _module(embed_dim=8, num_heads=H)
    x = torch.randn(B, T, 8, dtype=F64)
    kpm = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    got, w = m(x, key_mask=kpm, backend="math", return_weights=True)
    for b in range(B):
        alone = m(x[b:b + 1], key_mask=kpm[b:b + 1], backend=backend)
        torch.testing.assert_close(m(x, key_mask=kpm, backend=backend)[b:b + 1], alone, rtol=0, atol=1e-12)
        assert (w[b][..., ~kpm[b]] == 0).all()
    assert not torch.allclose(got, m(x, attn_mask=kpm, backend=backend))  # the (T, S) reading differs


def _strided_inputs(B=2, T=5, S=6, C=8):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(T, B, C, generator=g, dtype=F64).transpose(0, 1)  # transposed
    k = torch.randn(B, 1, C, generator=g, dtype=F64).expand(B, S, C)  # stride 0
    v = torch.randn(B, S, 2 * C, generator=g, dtype=F64)[..., ::2]  # every other feature
    kpm = (torch.rand(S, B, generator=g) > 0.3).t()  # transposed
    kpm[:, 0] = True
    attn = torch.randn(S, T, generator=g, dtype=F64).t()  # transposed float mask
    attn4 = (torch.rand(1, 1, 1, S, generator=g) > 0.2).expand(B, 2, T, S)  # expanded bool mask
    return q, k, v, kpm, attn, attn4


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_non_contiguous_inputs_and_masks(backend, num_kv_heads):
    m = _module(embed_dim=8, num_heads=2, num_kv_heads=num_kv_heads)
    q, k, v, kpm, attn, attn4 = _strided_inputs()
    assert not any(t.is_contiguous() for t in (q, k, v, kpm, attn, attn4))
    c = [t.contiguous() for t in (q, k, v, kpm, attn, attn4)]
    for mask, mask_c in ((attn, c[4]), (attn4, c[5])):
        got = m(q, k, v, attn_mask=mask, key_mask=kpm, is_causal=True, backend=backend)
        want = m(c[0], c[1], c[2], attn_mask=mask_c, key_mask=c[3], is_causal=True, backend=backend)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(m(q, backend=backend), m(c[0], backend=backend), rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,T,S", [(2, 0, None), (0, 3, None), (2, 0, 4), (0, 3, 4), (2, 3, 0)])
def test_empty_inputs_give_right_shapes_and_zero_grads(backend, B, T, S):
    m = _module(embed_dim=8, num_heads=4, num_kv_heads=2)
    x = torch.randn(B, T, 8, dtype=F64, requires_grad=True)
    key = None if S is None else torch.randn(B, S, 8, dtype=F64, requires_grad=True)
    out = m(x, key, is_causal=True, causal_alignment="bottom_right", backend=backend)
    assert out.shape == (B, T, 8)
    if S == 0:  # nothing to attend to: zeros before out_proj
        torch.testing.assert_close(out, m.out_proj.bias.expand(B, T, 8), rtol=0, atol=0)
    (out * torch.randn_like(out)).sum().backward()
    assert x.grad.shape == x.shape and not x.grad.any()
    if key is not None:
        assert key.grad.shape == key.shape and not key.grad.any()
    for name, p in m.named_parameters():  # only out_proj.bias reaches the output when S = 0
        assert p.grad is not None and not p.grad.isnan().any(), name
        assert (S == 0 and B * T > 0 and name == "out_proj.bias") or not p.grad.any(), name
    if S is None or S > 0:
        _, w = m(x, key, return_weights=True)
        assert w.shape == (B, 4, T, T if S is None else S)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kpm_dtype", [torch.bool, F64])
def test_fully_padded_batch_row_gives_out_proj_bias_and_zero_grads(backend, kpm_dtype):
    m = _module(embed_dim=8, num_heads=4, num_kv_heads=1)
    x = torch.randn(3, 5, 8, dtype=F64, requires_grad=True)
    keep = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    kpm = keep if kpm_dtype == torch.bool else torch.zeros(3, 5, dtype=F64).masked_fill(~keep, float("-inf"))
    out = m(x, key_mask=kpm, is_causal=True, backend=backend)
    assert not out.isnan().any()
    torch.testing.assert_close(out[1], m.out_proj.bias.expand(5, 8), rtol=0, atol=0)
    torch.testing.assert_close(out[0:1], m(x[0:1], key_mask=kpm[0:1], is_causal=True), rtol=0, atol=1e-12)
    (out * torch.randn_like(out)).sum().backward()
    assert not x.grad.isnan().any()
    assert not x.grad[1].any() and x.grad[0].any() and x.grad[2].any()
    assert all(not p.grad.isnan().any() for p in m.parameters())
    _, w = m(x, key_mask=kpm, return_weights=True)
    assert not w[1].any() and not w.isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bottom_right_rows_with_no_key_give_bias_and_zero_grads(backend):
    """T > S with bottom-right alignment: the first T - S queries see nothing."""
    m = _module(embed_dim=8, num_heads=4, num_kv_heads=2)
    x = torch.randn(2, 5, 8, dtype=F64, requires_grad=True)
    key = torch.randn(2, 3, 8, dtype=F64, requires_grad=True)
    out = m(x, key, is_causal=True, causal_alignment="bottom_right", backend=backend)
    assert not out.isnan().any()
    torch.testing.assert_close(out[:, :2], m.out_proj.bias.expand(2, 2, 8), rtol=0, atol=0)
    torch.testing.assert_close(out[:, 2:], m(x[:, 2:], key, is_causal=True, backend=backend), rtol=0, atol=1e-12)
    (out * torch.randn_like(out)).sum().backward()
    assert not x.grad[:, :2].any() and x.grad[:, 2:].all(dim=-1).any() and not key.grad.isnan().any()
    _, w = m(x, key, is_causal=True, causal_alignment="bottom_right", return_weights=True)
    assert not w[:, :, :2].any() and torch.allclose(w[:, :, 2:].sum(-1), torch.ones((), dtype=F64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_at_padded_keys_do_not_change_the_output(backend, bad):
    m = _module(embed_dim=8, num_heads=2, kdim=6, vdim=6)
    x, key = torch.randn(2, 3, 8, dtype=F64), torch.randn(2, 5, 6, dtype=F64)
    keep = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 1, 1]], dtype=torch.bool)
    want = m(x, key, key_mask=keep, backend=backend)
    poisoned = key.clone()
    poisoned[0, 4, 1] = bad
    poisoned[1, 2, :] = bad
    torch.testing.assert_close(m(x, poisoned, key_mask=keep, backend=backend), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_at_a_visible_key_stays_in_the_affected_rows(backend):
    m = _module(embed_dim=8, num_heads=2)
    x = torch.randn(2, 4, 8, dtype=F64)
    x[0, 2, 3] = float("nan")
    out = m(x, is_causal=True, backend=backend)
    assert out[0, 2:].isnan().any(dim=-1).all()  # rows that may see position 2
    assert not out[0, :2].isnan().any() and not out[1].isnan().any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_large_activations_stay_finite(backend, dtype):
    """q = k = 300-sized scores overflow float16 unless accumulated in float32
    (pytorch#119131); the result stays close to the float64 module.

    The values differ by position (v = x[..., 0] - x[..., 1] = 4t, exact in
    both dtypes) and each query's scores peak at its own position, so the
    tolerance rejects the obvious wrong answers (negative controls below)."""
    m = _module(embed_dim=64, num_heads=1, qkv_bias=False)
    value_rows = torch.zeros(64, 64, dtype=F64)
    value_rows[:, 0], value_rows[:, 1] = 1.0, -1.0
    with torch.no_grad():
        m.qkv_proj.weight.copy_(torch.cat([torch.eye(64, dtype=F64)] * 2 + [value_rows]))  # q = k = x
    x = torch.full((1, 4, 64), 300.0, dtype=F64)
    x[0, :, 0] += 4 * torch.arange(4, dtype=F64)
    want = m(x, is_causal=True)
    tolerance = dict(rtol=2e-2, atol=want.abs().max().item() * 2e-2)
    first_key_only = torch.zeros(4, 4, dtype=torch.bool)
    first_key_only[:, 0] = True
    for wrong in (m(x), m(x, attn_mask=first_key_only), torch.zeros_like(want)):  # not causal; key 0; zeros
        with pytest.raises(AssertionError):
            torch.testing.assert_close(wrong, want, **tolerance)
    got = m.to(dtype)(x.to(dtype), is_causal=True, backend=backend)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, **tolerance)


def _plain_low_precision(m, x, causal):
    """The plain PyTorch computation in the module's dtype: no fp32 accumulation."""
    q, k, v = m.project(x)
    R = m.num_heads // m.num_kv_heads
    k, v = k.repeat_interleave(R, dim=1), v.repeat_interleave(R, dim=1)
    scores = (q @ k.transpose(-1, -2)) * m.head_dim**-0.5
    if causal:
        T = x.shape[1]
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return m.merge_heads(torch.softmax(scores, dim=-1) @ v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_error_at_most_2x_plain_outputs_3x_grads(dtype, causal, backend):
    """docs/testing.md: error against float64 <= 2x (outputs) / 3x (input
    gradients) the plain same-dtype computation's error, plus a noise floor."""
    lp = _module(embed_dim=64, num_heads=4, num_kv_heads=2, dtype=dtype)
    with torch.no_grad():
        for p in lp.parameters():
            p.mul_(0.25)
    m64 = _module(embed_dim=64, num_heads=4, num_kv_heads=2)
    m64.load_state_dict({k: v.double() for k, v in lp.state_dict().items()})
    x = torch.randn(2, 63, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    g = torch.randn(2, 63, 64, generator=torch.Generator().manual_seed(1), dtype=F64)
    results = {}
    for name, fn in (("ref", lambda t: m64(t, is_causal=causal)),
                     ("plain", lambda t: _plain_low_precision(lp, t, causal)),
                     ("module", lambda t: lp(t, is_causal=causal, backend=backend))):
        xi = (x.double() if name == "ref" else x).clone().requires_grad_()
        out = fn(xi)
        (out.double() * g).sum().backward()
        results[name] = (out.detach().double(), xi.grad.double())
    for i, factor in ((0, 2.0), (1, 3.0)):
        ref = results["ref"][i]
        err_plain = (results["plain"][i] - ref).abs().max().item()
        err_mod = (results["module"][i] - ref).abs().max().item()
        assert err_mod <= factor * err_plain + 1e-5 * max(1.0, ref.abs().max().item()), (i, err_mod, err_plain)


@pytest.mark.parametrize("backend", BACKENDS)
def test_same_inputs_twice_bitwise_equal_forward_and_backward(backend):
    m = _module(embed_dim=12, num_heads=4, num_kv_heads=2)
    x = torch.randn(2, 6, 12, dtype=F64, requires_grad=True)
    kpm = torch.rand(2, 6) > 0.3
    runs = []
    for _ in range(2):
        x.grad = None
        m.zero_grad()
        out = m(x, key_mask=kpm, is_causal=True, backend=backend)
        out.pow(2).sum().backward()
        runs.append((out.detach(), x.grad.clone(), [p.grad.clone() for p in m.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_matches_cpu(backend):
    m = _module(embed_dim=12, num_heads=4, num_kv_heads=2)
    x = torch.randn(2, 6, 12, dtype=F64)
    kpm = torch.tensor([[1] * 6, [0] * 6], dtype=torch.bool)
    want = m(x, key_mask=kpm, is_causal=True, backend=backend)
    got = m.cuda()(x.cuda(), key_mask=kpm.cuda(), is_causal=True, backend=backend)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-12)
    cache = m.make_kv_cache(2, 8)
    assert cache.k.device.type == "cuda"
    with pytest.raises(ValueError, match="differ in dtype/device"):
        m(x.cuda(), x)


def test_a_key_width_other_than_c_with_values_of_width_c_uses_split_projections():
    """catches: fusing q|k|v when only one of kdim, vdim equals embed_dim."""
    m = _module(embed_dim=8, num_heads=2, kdim=6)  # vdim defaults to embed_dim
    assert not m.fused and m.k_proj.in_features == 6 and m.v_proj.in_features == 8
    x, key, value = torch.randn(2, 3, 8, dtype=F64), torch.randn(2, 4, 6, dtype=F64), torch.randn(2, 4, 8, dtype=F64)
    assert m(x, key, value).shape == (2, 3, 8)


def test_cost_defaults_and_cache_bytes():
    """catches: other defaults (batch 1, 2 bytes per element) or a wrong cache formula (2 G D bytes)."""
    m = _module(embed_dim=16, num_heads=4, num_kv_heads=2)  # D = 4
    assert m.cost(3) == m.cost(3, batch=1, bytes_per_element=2)
    assert m.cost(3).kv_cache_bytes_per_token == 2 * 2 * 4 * 2
    assert m.cost(3, bytes_per_element=4).kv_cache_bytes_per_token == 2 * 2 * 4 * 4
    assert m.cost(3, batch=2).total_flops == 2 * m.cost(3).total_flops
