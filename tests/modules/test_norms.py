"""Per-head RMS QK-norm against a NumPy float64 computation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multihead.modules.norms import HeadRMSNorm, QKNorm

F64 = torch.float64


def np_rms(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps)
    return y if weight is None else y * weight


def test_matches_numpy_and_keys():
    norm = QKNorm(5, eps=1e-5, dtype=F64)
    assert sorted(norm.state_dict()) == ["k_norm.weight", "q_norm.weight"]
    assert norm.q_norm.weight.shape == norm.k_norm.weight.shape == (5,)
    assert torch.equal(norm.q_norm.weight, torch.ones(5, dtype=F64))
    with torch.no_grad():
        norm.q_norm.weight.normal_()
        norm.k_norm.weight.normal_()
    q, k = torch.randn(2, 4, 7, 5, dtype=F64), torch.randn(2, 2, 3, 5, dtype=F64)
    qn, kn = norm(q, k)
    np.testing.assert_allclose(qn.detach().numpy(), np_rms(q.numpy(), norm.q_norm.weight.detach().numpy(), 1e-5),
                               rtol=0, atol=1e-12)
    np.testing.assert_allclose(kn.detach().numpy(), np_rms(k.numpy(), norm.k_norm.weight.detach().numpy(), 1e-5),
                               rtol=0, atol=1e-12)


def test_without_affine():
    norm = QKNorm(4, elementwise_affine=False)
    assert list(norm.parameters()) == [] and norm.q_norm.weight is None
    x = torch.randn(3, 2, 4, 4, dtype=F64)
    q, _ = norm(x, x)
    np.testing.assert_allclose(q.numpy(), np_rms(x.numpy(), None, 1e-6), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_computed_in_float32(dtype):
    norm = HeadRMSNorm(64)
    x = (torch.randn(2, 3, 64) * 300).to(dtype)  # squares overflow float16 if computed there
    y = norm(x)
    assert y.dtype == dtype and torch.isfinite(y).all()
    want = np_rms(x.double().numpy(), None, 1e-6)
    err = np.abs(y.detach().double().numpy() - want).max()
    assert err <= torch.finfo(dtype).eps * np.abs(want).max()


def test_gradcheck():
    norm = QKNorm(3, dtype=F64)
    q = torch.randn(1, 2, 2, 3, dtype=F64, requires_grad=True)
    k = torch.randn(1, 1, 2, 3, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: norm(a, b), (q, k))


def test_errors():
    with pytest.raises(ValueError, match="head_dim"):
        QKNorm(0)
    with pytest.raises(ValueError, match="eps=-1"):
        QKNorm(4, eps=-1.0)
    with pytest.raises(ValueError, match="head_dim=4"):
        QKNorm(4)(torch.randn(1, 1, 2, 5), torch.randn(1, 1, 2, 4))
