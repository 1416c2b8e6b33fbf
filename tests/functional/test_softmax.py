"""masked_softmax: hidden keys excluded, empty rows zero, half accumulated in float32."""

from __future__ import annotations

import itertools

import pytest
import torch

from multihead.functional import masked_softmax


def reference(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Row by row: softmax over the allowed entries only, float64."""
    out = torch.zeros_like(scores, dtype=torch.float64)
    for idx in itertools.product(*(range(n) for n in scores.shape[:-1])):
        keep = allowed.expand_as(scores)[idx]
        if keep.any():
            out[idx][keep] = torch.softmax(scores[idx][keep].double(), dim=-1)
    return out


def test_matches_the_row_by_row_softmax_over_allowed_keys():
    torch.manual_seed(0)
    scores = torch.randn(2, 3, 5, 7, dtype=torch.float64)
    allowed = torch.rand(5, 7) > 0.5
    allowed[2] = False  # a query that may see nothing
    got = masked_softmax(scores, allowed)
    torch.testing.assert_close(got, reference(scores, allowed), rtol=1e-10, atol=1e-12)
    assert (got[:, :, 2] == 0).all()
    torch.testing.assert_close(masked_softmax(scores, None), torch.softmax(scores, dim=-1), rtol=1e-10, atol=1e-12)


def test_hidden_nan_changes_nothing_and_empty_rows_have_zero_gradient():
    torch.manual_seed(1)
    scores = torch.randn(4, 6, dtype=torch.float64)
    allowed = torch.ones(4, 6, dtype=torch.bool).tril()
    allowed[1] = False
    poisoned = scores.masked_fill(~allowed, float("nan")).requires_grad_(True)
    # Same operations on the same shapes (only hidden values differ): bitwise.
    assert torch.equal(masked_softmax(poisoned, allowed), masked_softmax(scores, allowed))
    (masked_softmax(poisoned, allowed) * torch.randn(4, 6, dtype=torch.float64)).sum().backward()
    assert torch.isfinite(poisoned.grad).all() and (poisoned.grad[1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_scores_are_computed_in_float32(dtype):
    torch.manual_seed(2)
    scores = (torch.randn(3, 9) * 4).to(dtype)
    allowed = torch.rand(3, 9) > 0.3
    got = masked_softmax(scores, allowed)
    assert got.dtype == dtype
    want = reference(scores.float(), allowed).float().to(dtype)  # one rounding of the exact result
    torch.testing.assert_close(got, want)


def test_errors_name_the_values():
    with pytest.raises(TypeError, match="scores must be a floating torch.Tensor, got torch.int64"):
        masked_softmax(torch.ones(2, 2, dtype=torch.long), None)
    with pytest.raises(TypeError, match="allowed must be a bool torch.Tensor .* got torch.float32"):
        masked_softmax(torch.ones(2, 2), torch.ones(2, 2))
