"""Helpers shared by the tests of ``multihead.functional``."""

from __future__ import annotations

import numpy as np
import torch

from multihead.functional import attention
from multihead.reference import attention as reference

BACKENDS = ("math", "sdpa")
F64 = torch.float64


def make_qkv(rng, B, H, G, T, S, D, Dv=None, dtype=F64, requires_grad=False):
    """Random q (B, H, T, D), k (B, G, S, D), v (B, G, S, Dv) from a NumPy rng."""
    Dv = D if Dv is None else Dv
    shapes = ((B, H, T, D), (B, G, S, D), (B, G, S, Dv))
    out = []
    for shape in shapes:
        t = torch.from_numpy(rng.standard_normal(shape)).to(dtype)
        out.append(t.requires_grad_(requires_grad))
    return tuple(out)


def np64(t: torch.Tensor | None):
    """A tensor as a float64 (or bool) NumPy array; None stays None."""
    if t is None:
        return None
    t = t.detach()
    return t.numpy() if t.dtype == torch.bool else t.to(F64).numpy()


def run_reference(q, k, v, mask=None, **kw):
    """The NumPy float64 specification on torch inputs; returns torch tensors."""
    res = reference(np64(q), np64(k), np64(v), mask=np64(mask), return_weights=True, **kw)
    return tuple(torch.from_numpy(np.ascontiguousarray(r)) for r in res)


def assert_matches(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-10) -> None:
    """Max abs error <= tol scaled by the output magnitude (NaN must match NaN)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    got, want = got.detach().to(F64), want.to(F64)
    nan_got, nan_want = torch.isnan(got), torch.isnan(want)
    assert torch.equal(nan_got, nan_want), "NaN pattern differs from the reference"
    ok = ~nan_want
    if not bool(ok.any()):
        return
    g, w = got[ok], want[ok]
    assert torch.equal(torch.isinf(g), torch.isinf(w)), "inf pattern differs"
    fin = torch.isfinite(w)
    if bool(fin.any()):
        scale = max(1.0, float(w[fin].abs().max()))
        err = float((g[fin] - w[fin]).abs().max())
        assert err <= tol * scale, f"max abs error {err:.3e} > {tol:.1e} * {scale:.3g}"
    assert torch.equal(g[~fin], w[~fin])


def check_against_reference(q, k, v, backend, attn_mask=None, tol=1e-10, **kw):
    """Run ``attention`` and compare outputs (and math weights) to the reference."""
    want_out, want_w = run_reference(q, k, v, attn_mask, **kw)
    if backend == "math":
        out, w = attention(q, k, v, attn_mask=attn_mask, backend=backend,
                           return_weights=True, **kw)
        assert_matches(w, want_w, tol)
    else:
        out = attention(q, k, v, attn_mask=attn_mask, backend=backend, **kw)
    assert_matches(out, want_out, tol)
    return out


def grads(out: torch.Tensor, *inputs: torch.Tensor, seed: int = 1):
    """Gradients of <out, g> for a fixed random g, w.r.t. ``inputs``."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)
    return torch.autograd.grad((out * g).sum(), inputs, allow_unused=False)
