"""Attention observers: exact weights handed to callbacks, nothing when none."""

from __future__ import annotations

import pytest
import torch
from support.modules import random_module
from support.paths import assert_paths_agree


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
    # return_weights with gradients runs the math path, the observer the fused kernel's log-sum-exp
    assert_paths_agree(event.weights, weights.detach())
    assert event.heads == (0, 1, 2, 3) and event.rows == (0, 1, 2, 3, 4)
    assert event.q.shape == (2, 4, 5, 3) and event.k.shape == (2, m.num_kv_heads, 5, 3)
    torch.testing.assert_close(event.v, m.project(x)[2].detach())  # the projected values
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


def test_observing_with_the_fused_backend_named_explicitly():
    """Observers need no gradient through the weights: the fused kernel serves them."""
    m = random_module(embed_dim=8, num_heads=2)
    events, _ = _collect(m)
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    out = m(x, backend="sdpa")
    with torch.no_grad():
        want_out, want = m(x, return_weights=True, backend="math")
    assert_paths_agree(events[0][1].weights, want)
    assert_paths_agree(out, want_out)


def test_observing_under_dropout_in_training_says_why_the_kernel_cannot_serve():
    m = random_module(embed_dim=8, num_heads=2, dropout=0.5).train()
    _collect(m)
    with pytest.raises(ValueError, match=r"'sdpa' cannot serve.*dropout in training"):
        m(torch.randn(1, 3, 8, dtype=torch.float64), backend="sdpa")


def test_an_observer_of_some_heads_and_rows_gets_only_those(monkeypatch):
    """MHA observed for one head and one row: the explicit softmax never runs, the
    event holds [B, 1, 1, S] and says which head and row."""
    import multihead.functional.math_backend as math_backend

    m = random_module(embed_dim=12, num_heads=4, num_kv_heads=2)
    x = torch.randn(2, 7, 12, dtype=torch.float64)
    with torch.no_grad():
        _, full = m(x, is_causal=True, return_weights=True)
    events = []
    m.register_attention_observer(lambda mod, event: events.append(event), heads=[2], rows=[-1])

    def refuse(*args, **kwargs):
        raise AssertionError("the explicit softmax ran")

    monkeypatch.setattr(math_backend, "masked_softmax", refuse)
    out = m(x, is_causal=True)
    (event,) = events
    assert event.weights.shape == (2, 1, 1, 7) and (event.heads, event.rows) == ((2,), (6,))
    assert_paths_agree(event.weights, full[:, 2:3, 6:7])
    out.sum().backward()  # the output keeps the fused kernel's gradients
    assert all(p.grad is not None for p in m.parameters())


def test_a_kind_with_its_own_core_cuts_the_parts_from_every_weight():
    """gated scales each head's weights by its gate in its own core: the layer asks
    for every weight and hands the observer its part."""
    from multihead import build_attention

    torch.manual_seed(0)
    m = build_attention("gated", embed_dim=8, num_heads=4, dtype=torch.float64).eval()
    assert not type(m).selects_weights and random_module(embed_dim=8, num_heads=2).selects_weights
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    with torch.no_grad():
        _, full = m(x, return_weights=True)
    events = []
    m.register_attention_observer(lambda mod, event: events.append(event), heads=[1, 3], rows=slice(0, 2))
    with torch.no_grad():
        m(x)
    assert torch.equal(events[0].weights, full[:, [1, 3], :2])  # the same path, cut: bitwise


def test_selections_outside_the_call_are_refused_before_the_cache_is_written():
    m = random_module(embed_dim=8, num_heads=2)
    cache = m.make_kv_cache(1, 8)
    m.register_attention_observer(lambda mod, event: None, heads=[2])
    with pytest.raises(ValueError, match=r"heads=\[2\] asks for head 2, but the call has H=2"):
        m(torch.randn(1, 3, 8, dtype=torch.float64), is_causal=True, kv_cache=cache)
    assert cache.length == 0
    with pytest.raises(ValueError, match=r"ascending"):
        m.register_attention_observer(lambda mod, event: None, rows=[3, 1])


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
    W, b = ours.attention.projection_weights()["v"]  # (E, E), (E,)
    v = (x @ W.T + b).view(1, 3, 2, 4).transpose(1, 2)  # (B, T, E) -> (B, H, T, E/H)
    torch.testing.assert_close(events[0][1].v, v.detach(), rtol=1e-6, atol=1e-6)


def test_the_torch_drop_in_hands_each_observer_its_heads_and_rows():
    from torch import nn

    from multihead import TorchMultiheadAttention

    torch.manual_seed(0)
    ours = TorchMultiheadAttention.from_torch(nn.MultiheadAttention(8, 4, batch_first=True)).eval()
    events = []
    ours.attention.register_attention_observer(lambda mod, event: events.append(event), heads=[1, 2], rows=[-1])
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        _, per_head = ours(x, x, x, need_weights=True, average_attn_weights=False)
    (event,) = events
    assert (event.heads, event.rows) == ((1, 2), (4,))
    assert_paths_agree(event.weights, per_head[:, 1:3, 4:])
