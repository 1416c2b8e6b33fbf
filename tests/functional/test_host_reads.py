"""Host reads in one attention call: none where ``host_sync.sync_free`` holds.

Compiled code cannot branch on data, so every step has a branch-free form
(``host_sync``). These tests run it in eager mode (forced), count the host
reads the profiler sees (``aten::_local_scalar_dense``) in every mask
structure and every kind, and check that it gives the numbers of the eager
form, NaN and inf included, on the CPU and on CUDA.
"""

from __future__ import annotations

import pytest
import torch
from support.kinds import C, build

from multihead import MultiHeadAttention
from multihead.functional import WeightSelection, attention, host_sync
from multihead.modules.registry import list_attention_kinds

READS = ("aten::_local_scalar_dense", "aten::nonzero", "cudaStreamSynchronize", "cudaDeviceSynchronize")


def _reads(call) -> dict[str, int]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        call()
    return {e.key: e.count for e in prof.key_averages() if e.key in READS}


def _cases(device: str, dtype: torch.dtype):
    """name -> a call of one layer or of ``attention`` (q/k/v with a NaN in a
    masked key, an inf in a visible value, a NaN query row)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).to(device, dtype).eval()  # the same weights on every device
    x = randn(2, 5, 16)
    keys = torch.tensor([[True] * 5, [True] * 3 + [False] * 2], device=device)
    q, k, v = randn(2, 4, 5, 8), randn(2, 2, 7, 8), randn(2, 2, 7, 8)
    k[1, 0, 6, 3] = float("nan")  # future of every row under top-left causality
    v[0, 1, 2, 1] = float("inf")
    q[0, 2, 3, 0] = float("nan")
    rows = torch.rand(5, 7, generator=g).to(device) > 0.4
    bias = randn(5, 7).masked_fill(~rows, float("-inf"))
    return {
        "layer, causal": lambda: mha(x, is_causal=True),
        "layer, key mask": lambda: mha(x, key_mask=keys),
        "top-left causal": lambda: attention(q, k, v, is_causal=True),
        "bottom-right causal": lambda: attention(q, k, v, is_causal=True, causal_alignment="bottom_right"),
        "per-row mask": lambda: attention(q, k, v, attn_mask=rows),
        "float mask with -inf": lambda: attention(q, k, v, attn_mask=bias),
        "weights of one head": lambda: attention(
            q, k, v, is_causal=True, return_weights=WeightSelection(heads=[1]))[1],
        "math, every weight": lambda: attention(q, k, v, is_causal=True, backend="math", return_weights=True)[1],
    }


def _expected_reads(name: str, dtype: torch.dtype) -> dict[str, int]:
    """The one read that stays: choosing the fused kernel for a float mask with
    half-precision inputs range-checks the mask (its cast could make inf)."""
    if name == "float mask with -inf" and dtype in (torch.float16, torch.bfloat16):
        return {"aten::_local_scalar_dense": 1}
    return {}


def _sync_free(monkeypatch, value: bool) -> None:
    monkeypatch.setattr(host_sync, "sync_free", lambda: value)


TOL = {torch.float64: {}, torch.float32: {"atol": 1e-5, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("name", list(_cases("cpu", torch.float32)))
def test_the_branch_free_form_reads_nothing_back_and_equals_the_checked_one(name, dtype, monkeypatch):
    """catches: a ``bool()``/``.item()`` left on the branch-free path, or a
    branch-free patch that differs from the checked one or from float64
    (NaN/inf pattern included)."""
    _sync_free(monkeypatch, False)
    want = _cases("cpu", dtype)[name]()
    exact = _cases("cpu", torch.float64)[name]()
    _sync_free(monkeypatch, True)
    call = _cases("cpu", dtype)[name]
    assert _reads(call) == _expected_reads(name, dtype)
    got = call()
    torch.testing.assert_close(got, want, equal_nan=True, **TOL[dtype])
    assert torch.equal(got.isnan(), exact.isnan()) and torch.equal(got.isposinf(), exact.isposinf())


def test_the_checked_form_reads_on_the_cpu(monkeypatch):
    """The counter sees the check-first form's read (so an empty count means something)."""
    _sync_free(monkeypatch, False)
    assert _reads(_cases("cpu", torch.float32)["top-left causal"]).get("aten::_local_scalar_dense", 0) >= 1


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("branch_free", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(_cases("cpu", torch.float32)))
def test_cuda_calls_in_either_form_equal_the_cpu(name, dtype, branch_free, monkeypatch):
    """catches: CUDA numbers (NaN/inf pattern included) that differ from the
    CPU's, in the eager form or the branch-free one."""
    want = _cases("cpu", dtype)[name]()
    _sync_free(monkeypatch, branch_free)
    got = _cases("cuda", dtype)[name]()
    torch.testing.assert_close(got.cpu(), want, equal_nan=True, **TOL[dtype])


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_every_kind_forward_reads_nothing_back_where_sync_free(kind, monkeypatch):
    """catches: a kind whose own code (router, gates, chunking) reads a device
    value back on the branch-free path compiled code takes; causal and not."""
    _sync_free(monkeypatch, True)
    m = build(kind, dtype=torch.float32)
    x = torch.randn(2, 6, C, generator=torch.Generator().manual_seed(1))
    for causal in (False, True):
        assert _reads(lambda causal=causal: m(x, is_causal=causal)) == {}, f"{kind}, causal={causal}"



def test_the_eager_check_of_a_fused_projection_is_one_sum(monkeypatch):
    """catches: the check summing q, k and v apart (three sums and two adds) when they
    are views of one fused projection output that holds nothing else."""
    _sync_free(monkeypatch, False)
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        mha(x, is_causal=True)
    counts = {e.key: e.count for e in prof.key_averages()}
    assert counts.get("aten::sum") == 1 and counts.get("aten::_local_scalar_dense") == 1
