"""Attention observers: exact weights handed to callbacks, nothing when none."""

from __future__ import annotations

import pytest
import torch
from support.modules import random_module


def _collect(module):
    events = []
    handle = module.register_attention_observer(lambda mod, event: events.append((mod, event)))
    return events, handle


@pytest.mark.parametrize("num_kv_heads,kind", [(None, "mha"), (2, "gqa"), (1, "mqa")])
def test_observer_gets_the_exact_weights_and_output_is_unchanged(num_kv_heads, kind):
    m = random_module(embed_dim=12, num_heads=4, num_kv_heads=num_kv_heads)
    x = torch.randn(2, 5, 12, dtype=torch.float64)
    plain = m(x, is_causal=True)
    out, weights = m(x, is_causal=True, return_weights=True)
    events, handle = _collect(m)
    observed_out = m(x, is_causal=True)
    assert isinstance(observed_out, torch.Tensor)  # observing does not change the return type
    torch.testing.assert_close(observed_out, plain, rtol=0, atol=1e-12)
    (mod, event), = events
    assert mod is m and event.kind == kind and event.is_causal
    assert torch.equal(event.weights, weights)
    assert event.q.shape == (2, 4, 5, 3) and event.k.shape == (2, m.num_kv_heads, 5, 3)
    assert event.scale == pytest.approx(3**-0.5)
    assert not event.weights.requires_grad
    handle.remove()
    m(x)
    assert len(events) == 1 and not m.observed


def test_scores_can_be_rebuilt_from_the_event():
    m = random_module(embed_dim=8, num_heads=2)
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    events, _ = _collect(m)
    m(x)
    event = events[0][1]
    scores = event.q @ event.k.transpose(-1, -2) * event.scale
    torch.testing.assert_close(torch.softmax(scores, dim=-1), event.weights, rtol=0, atol=1e-12)


def test_several_observers_and_a_kv_cache():
    m = random_module(embed_dim=8, num_heads=2, num_kv_heads=1)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    a, _ = _collect(m)
    b, _ = _collect(m)
    cache = m.make_kv_cache(1, 6)
    m(x[:, :4], is_causal=True, kv_cache=cache)
    m(x[:, 4:5], is_causal=True, kv_cache=cache)
    assert len(a) == len(b) == 2
    step = a[1][1]
    assert step.k.shape[2] == 5 and step.weights.shape == (1, 2, 1, 5)
    assert step.causal_alignment == "bottom_right"


def test_observing_with_the_fused_backend_named_explicitly_says_why():
    m = random_module(embed_dim=8, num_heads=2)
    _collect(m)
    with pytest.raises(ValueError, match="return_weights"):
        m(torch.randn(1, 3, 8, dtype=torch.float64), backend="sdpa")


def test_observer_must_be_callable():
    with pytest.raises(TypeError, match="observer must be callable"):
        random_module(embed_dim=8, num_heads=2).register_attention_observer("not a function")


def test_the_torch_drop_in_notifies_observers_of_its_inner_module():
    from torch import nn

    from multihead import TorchMultiheadAttention

    torch.manual_seed(0)
    ours = TorchMultiheadAttention.from_torch(nn.MultiheadAttention(8, 2, batch_first=True)).eval()
    events, _ = _collect(ours.attention)
    x = torch.randn(1, 3, 8)
    out, weights = ours(x, x, x, need_weights=False)
    assert weights is None and len(events) == 1
    _, per_head = ours(x, x, x, need_weights=True, average_attn_weights=False)
    torch.testing.assert_close(events[0][1].weights, per_head)
