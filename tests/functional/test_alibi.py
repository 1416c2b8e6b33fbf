"""ALiBi slopes and biases against BLOOM's own code in transformers (the independent reference)."""

import pytest
import torch

from multihead.functional import alibi_bias, alibi_slopes, causal_mask

bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")


@pytest.mark.parametrize("heads", [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 32, 40, 71, 112])
def test_slopes_equal_blooms_for_any_head_count(heads):
    want = bloom._get_alibi_slopes(heads, torch.device("cpu"))
    torch.testing.assert_close(alibi_slopes(heads), want, rtol=1e-6, atol=1e-9)


def test_slopes_refuse_a_head_count_that_is_not_positive():
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


@pytest.mark.parametrize("T, S", [(6, 6), (1, 9), (3, 9)])
def test_causal_weights_equal_blooms_key_position_bias(T, S):
    """BLOOM adds slope·j per key; ours is -slope·|i - j|: the same weights under a causal mask."""
    heads, g = 5, torch.Generator().manual_seed(0)
    scores = torch.randn(1, heads, T, S, generator=g, dtype=torch.float64)
    keep = causal_mask(T, S, alignment="bottom_right")  # the cache's keys come first
    blooms = bloom.build_alibi_tensor(torch.ones(1, S), heads, torch.float64).view(1, heads, 1, S)
    ours = alibi_bias(alibi_slopes(heads, dtype=torch.float64), T, S, alignment="bottom_right")[None]
    want = (scores + blooms).masked_fill(~keep, float("-inf")).softmax(-1)
    got = (scores + ours).masked_fill(~keep, float("-inf")).softmax(-1)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(scores.masked_fill(~keep, float("-inf")).softmax(-1), want)  # the bias matters


def test_bias_is_zero_on_the_diagonal_and_falls_with_distance_both_ways():
    b = alibi_bias(torch.tensor([0.5]), 4, 6)[0]
    assert torch.equal(b.diagonal(), torch.zeros(4)) and b[0, 5] == -2.5 and b[3, 0] == -1.5
    assert alibi_bias(torch.tensor([0.5]), 4, 6, alignment="bottom_right")[0, 0, 2] == 0  # query 0 is key 2
