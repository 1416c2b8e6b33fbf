"""The non-finite rows of RELIABILITY.md on CUDA: NaN and inf at hidden keys
change nothing, NaN and inf a query may see show in its output, rows that see
no key are 0. Causal, padding, per-row mask and GQA inputs, float32 and
bfloat16, through ``functional.attention`` (each backend) and
``MultiHeadAttention``, each against the math path on the CPU in float64 on
the same (rounded) inputs.

Tolerances (docs/testing.md): float32 within torch.testing's defaults scaled
by the output's magnitude; bfloat16 within 3e-2 of it (the kernels round the
weights to bfloat16 before they mix the values). NaN, +inf and -inf must sit
at exactly the reference's entries.
"""

from __future__ import annotations

import pytest
import torch

from multihead import MultiHeadAttention
from multihead.functional import attention, padding_mask_from_lengths

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NAN, INF = float("nan"), float("inf")
D = 16  # a head width every fused CUDA kernel takes


def _qkv(B, H, G, T, S, dtype):
    g = torch.Generator().manual_seed(5)
    return tuple(torch.randn(B, n, L, D, generator=g).to(dtype) for n, L in ((H, T), (G, S), (G, S)))


def _causal(dtype):
    """Top-left causal, T = S = 6: key 4 is hidden from rows 0-3, key 5 from rows 0-4."""
    q, k, v = _qkv(2, 4, 4, 6, 6, dtype)
    k[0, 1, 5, 3] = NAN  # seen by row 5 of head 1 only
    v[0, 2, 4, 7] = INF  # feature 7 of rows 4, 5 of head 2: +inf
    v[1, 0, 4, 2], v[1, 0, 5, 2] = INF, -INF  # feature 2: +inf in row 4, NaN in row 5 (both infinities)
    q[1, 3, 2, 0] = NAN  # row 2 of head 3 sees keys 0-2: NaN
    return (q, k, v), {"is_causal": True}


def _padding(dtype):
    """Right padding, lengths 7, 4, 0 (the last item's rows see no key)."""
    q, k, v = _qkv(3, 4, 4, 5, 7, dtype)
    k[0, 0, 2, 1] = NAN  # visible: every row of head 0
    k[1, 1, 5] = NAN  # padded: changes nothing
    v[1, 2, 6, 3] = INF  # padded
    v[1, 3, 1, 4] = -INF  # visible: feature 4 of head 3 is -inf
    q[2, :, 1] = NAN  # a row of an item that sees no key: stays 0
    k[2, 0, 0] = NAN
    return (q, k, v), {"attn_mask": padding_mask_from_lengths([7, 4, 0], 7)}


def _per_row(dtype):
    """A (T, S) mask that differs between query rows; row 3 sees no key."""
    q, k, v = _qkv(2, 4, 4, 5, 6, dtype)
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[0, 2] = mask[1, 4] = mask[2, :3] = False
    mask[3] = False
    k[0, 1, 2, 0] = NAN  # hidden from row 0 (and 2, 3) only
    v[1, 0, 4, 5] = NAN  # hidden from row 1 (and 3) only
    q[1, 2, 3] = INF  # row 3 sees nothing: 0
    return (q, k, v), {"attn_mask": mask}


def _gqa(dtype):
    """H = 4 query heads over G = 2 key/value heads, padding and causality together."""
    q, k, v = _qkv(2, 4, 2, 6, 6, dtype)
    k[0, 1, 5, 2] = NAN  # group 1 (heads 2, 3), visible to row 5 only
    v[0, 0, 3, 1] = -INF  # group 0 (heads 0, 1), rows 3-5, feature 1
    k[1, 0, 4] = INF  # padded in item 1: hidden from every row
    v[1, 1, 5, 0] = NAN  # padded
    mask = padding_mask_from_lengths([6, 4], 6)
    return (q, k, v), {"attn_mask": mask, "is_causal": True}


CASES = {"causal": _causal, "padding": _padding, "per_row_mask": _per_row, "gqa": _gqa}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _on(device, kw):
    return {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}


def assert_nonfinite_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """NaN, +inf, -inf at the same entries; the finite ones within the dtype's tolerance."""
    got = got.detach().cpu().double()
    assert got.shape == want.shape, (got.shape, want.shape)
    for flag in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(flag(got), flag(want)), f"{flag.__name__} entries differ from the reference"
    fin = torch.isfinite(want)
    scale = max(1.0, float(want[fin].abs().max())) if bool(fin.any()) else 1.0
    tol = {"rtol": 1.3e-6, "atol": 1e-5 * scale} if want.dtype == torch.float32 else {"rtol": 0, "atol": 3e-2 * scale}
    torch.testing.assert_close(got[fin], want[fin].double(), **tol)


def _reference(q, k, v, kw, dtype):
    """The CPU math path in float64 on the same rounded inputs, with the dtype to judge by."""
    out = attention(q.double(), k.double(), v.double(), backend="math", **kw)
    return out.to(torch.float32) if dtype == torch.float32 else out


def check_functional(case: str, dtype: torch.dtype, backend: str, device: str) -> None:
    (q, k, v), kw = CASES[case](dtype)
    want = _reference(q, k, v, kw, dtype)
    bad = ~torch.isfinite(want)
    assert bool(bad.any()) and bool((~bad).any())  # the case shows both sides of the rule
    got = attention(q.to(device), k.to(device), v.to(device), backend=backend, **_on(device, kw))
    assert got.device.type == torch.device(device).type and got.dtype == dtype
    assert_nonfinite_close(got, want)
    # Hidden non-finite entries change nothing: the same call with them replaced by 0 (the finite
    # rows' outputs) equals the call with them.
    clean = attention(*(x.nan_to_num(0.0, 0.0, 0.0).to(device) for x in (q, k, v)), backend=backend,
                      **_on(device, kw))  # fmt: skip
    fin = torch.isfinite(want)
    untouched = fin.all(dim=-1)  # rows no non-finite entry reaches
    assert bool(untouched.any())
    assert_nonfinite_close(got[untouched.to(got.device)], want[untouched])
    assert_nonfinite_close(clean[untouched.to(clean.device)], want[untouched])


@needs_cuda
@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_nonfinite_inputs_follow_the_cpu_math_path(case, dtype, backend):
    check_functional(case, DTYPES[dtype], backend, "cuda")


def check_module(dtype: torch.dtype, device: str) -> None:
    """A NaN token at a padded position of a GQA layer, causal: only the rows
    that may see it (none) change; a NaN token that is real turns the rows
    that see it into NaN, and the weights of those rows too."""
    torch.manual_seed(0)
    m = MultiHeadAttention(64, 4, num_kv_heads=2, dtype=torch.float64).eval()
    x = torch.randn(2, 6, 64, dtype=torch.float64).to(dtype).double()  # values dtype can hold exactly
    x[0, 5] = NAN  # item 0: padded position 5
    x[1, 3, 7] = NAN  # item 1: a real token, seen by rows 3-5
    key_mask = torch.arange(6) < torch.tensor([[5], [6]])  # (B, S), True = a real token
    with torch.no_grad():
        gpu = MultiHeadAttention(64, 4, num_kv_heads=2, dtype=dtype, device=device).eval()
        gpu.load_state_dict(m.state_dict())
        got, got_w = gpu(x.to(device, dtype), key_mask=key_mask.to(device), is_causal=True, return_weights=True)
    # The float64 weights round to dtype in the GPU layer: judge it against a float64 layer holding them.
    ref = MultiHeadAttention(64, 4, num_kv_heads=2, dtype=torch.float64).eval()
    ref.load_state_dict({n: t.to(dtype).double() for n, t in m.state_dict().items()})
    with torch.no_grad():
        want, want_w = ref(x, key_mask=key_mask, is_causal=True, return_weights=True, backend="math")
    if dtype == torch.float32:
        want, want_w = want.float(), want_w.float()
    assert bool(torch.isfinite(want[0, :5]).all()) and bool(torch.isnan(want[1, 3:]).all())
    assert bool(torch.isfinite(want[1, :3]).all())
    assert_nonfinite_close(got, want)
    assert_nonfinite_close(got_w, want_w)


@needs_cuda
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cuda_module_with_nan_tokens_follows_the_cpu_math_path(dtype):
    check_module(DTYPES[dtype], "cuda")
