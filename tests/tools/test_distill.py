"""tools.distill: divergences against their definitions written out in float64."""

from __future__ import annotations

import pytest
import torch

from multihead.tools.distill import distillation, divergence

F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-12}


def _pair(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, dtype=F64, generator=g), torch.randn(shape, dtype=F64, generator=g)


def test_kl_is_the_teacher_weighted_log_ratio():
    s, t = _pair((2, 3, 5))
    p, q = t.exp() / t.exp().sum(-1, keepdim=True), s.exp() / s.exp().sum(-1, keepdim=True)
    want = (p * (p.log() - q.log())).sum(-1).mean()  # mean over the 2 * 3 rows
    torch.testing.assert_close(divergence(s, t, "kl"), want, **TIGHT)
    torch.testing.assert_close(divergence(t, t, "kl"), torch.zeros((), dtype=F64), rtol=0, atol=1e-12)


def test_cosine_and_mse():
    s, t = _pair((4, 6))
    cos = (s * t).sum(-1) / (s.norm(dim=-1) * t.norm(dim=-1))
    torch.testing.assert_close(divergence(s, t, "cosine"), (1 - cos).mean(), **TIGHT)
    torch.testing.assert_close(divergence(s, t, "mse"), ((s - t) ** 2).mean(), **TIGHT)


def test_gradient_reaches_the_student_only():
    s, t = _pair((3, 4))
    s.requires_grad_(True)
    t.requires_grad_(True)
    divergence(s, t, "kl").backward()
    assert s.grad is not None and t.grad is None


def test_low_precision_is_computed_in_float32():
    s, t = _pair((3, 4))
    assert divergence(s.bfloat16(), t.bfloat16(), "kl").dtype == torch.float32


def test_distillation_pairs_and_loss():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5))
    model.train()
    batches = [torch.randn(2, 3) for _ in range(2)]
    pairs, loss_fn = distillation(model, iter(batches), lambda m, x: m(x), objective="mse")
    assert model.training  # its mode is restored
    assert [b for b, _ in pairs] == batches
    model.eval()
    torch.testing.assert_close(pairs[1][1], model(batches[1]), rtol=0, atol=0)  # same call, same inputs
    assert float(loss_fn(model, pairs[0])) == 0.0
    with torch.no_grad():
        model[0].bias.add_(1.0)
    torch.testing.assert_close(loss_fn(model, pairs[0]), torch.tensor(1.0))  # every output moved by 1


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: divergence(torch.zeros(2), torch.zeros(3)), ValueError, r"student output shape \(2,\) != teacher"),
        (lambda: divergence(torch.zeros(2), torch.zeros(2), "l1"), ValueError, r"unknown objective='l1'"),
        (lambda: divergence(torch.zeros(2, dtype=torch.long), torch.zeros(2)), TypeError, "student output must be"),
        (lambda: divergence(torch.zeros(2), [0.0, 0.0]), TypeError, "teacher output must be .* got list"),
        (lambda: distillation(torch.nn.Linear(2, 2), [], lambda m, x: m(x)), ValueError, "batches is empty"),
        (lambda: distillation(torch.nn.Linear(2, 2), [torch.zeros(2)], None), TypeError, "outputs must be callable"),
    ],
)
def test_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()
