"""``capture(model, heads=, rows=, layers=)``: only what is asked for is recorded,
and it equals the same part of a full capture."""

from __future__ import annotations

import json

import pytest
import torch
from support.paths import assert_paths_agree
from torch import nn

from multihead import MultiHeadAttention, build_attention
from multihead.tools import AttentionRecord, attention_modules, capture
from multihead.tools.roles import classify_heads
from multihead.tools.visualize import write_html


class ThreeLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([
            MultiHeadAttention(8, 4, dtype=torch.float64),
            MultiHeadAttention(8, 4, num_kv_heads=2, dtype=torch.float64),
            build_attention("gated", embed_dim=8, num_heads=4, dtype=torch.float64),  # a core of its own
        ])

    def forward(self, x, causal=True, caches=None):
        for i, block in enumerate(self.blocks):
            x = x + block(x, is_causal=causal, kv_cache=None if caches is None else caches[i])
        return x


def _full(model, x, **kw):
    with torch.no_grad(), capture(model, scores=True) as record:
        out = model(x, **kw)
    return out, record


def test_some_heads_rows_and_layers_equal_that_part_of_a_full_capture():
    model = ThreeLayers().eval()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    want_out, full = _full(model, x)
    with torch.no_grad(), capture(model, heads=[1, 3], rows=[0, -1], layers=[1, 2], scores=True) as record:
        out = model(x)
    assert_paths_agree(out, want_out)
    assert [(e.layer, e.heads, e.rows) for e in record.layers] == [(1, (1, 3), (0, 5)), (2, (1, 3), (0, 5))]
    for entry in record.layers:
        assert entry.weights.shape == (2, 2, 2, 6) and entry.weights.dtype == torch.float32
        whole = full.layers[entry.layer]
        assert_paths_agree(entry.weights, whole.weights[:, [1, 3]][:, :, [0, 5]])
        assert torch.equal(torch.isneginf(entry.scores), torch.isneginf(whole.scores[:, [1, 3]][:, :, [0, 5]]))
        assert_paths_agree(entry.scores.masked_fill(torch.isneginf(entry.scores), 0),
                           whole.scores[:, [1, 3]][:, :, [0, 5]].masked_fill(torch.isneginf(entry.scores), 0))
    assert torch.equal(record.head(0, 3, batch=1), record.layers[0].weights[1, 1])
    with pytest.raises(IndexError, match=r"head 2 was not captured in layer 0: it holds heads \[1, 3\]"):
        record.head(0, 2)


def test_the_last_query_of_every_generation_step():
    """rows=slice(-1, None) resolves against each call's T: the prompt's last query, then each new token."""
    model = ThreeLayers().eval()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    caches = [b.make_kv_cache(1, 5) for b in model.blocks]
    with torch.no_grad(), capture(model, rows=slice(-1, None), layers=[0]) as record:
        model(x[:, :3], caches=caches)
        model(x[:, 3:4], caches=caches)
        model(x[:, 4:5], caches=caches)
    _, full = _full(model, x)
    assert [(e.weights.shape, e.rows) for e in record.layers] == [((1, 4, 1, 3), (2,)), ((1, 4, 1, 4), None),
                                                                 ((1, 4, 1, 5), None)]
    for t, entry in zip((2, 3, 4), record.layers):
        assert_paths_agree(entry.weights, full.layers[0].weights[:, :, t : t + 1, : t + 1])


def test_json_round_trip_keeps_the_heads_and_rows(tmp_path):
    model = ThreeLayers().eval()
    with torch.no_grad(), capture(model, heads=[2], rows=slice(1, 3)) as record:
        model(torch.randn(1, 4, 8, dtype=torch.float64))
    record.query_tokens = ["a", "b", "c", "d"]
    data = json.loads(record.save_json(tmp_path / "heads.json").read_text())
    assert data["layers"][0]["heads"] == [2] and data["layers"][0]["rows"] == [1, 2]
    back = AttentionRecord.from_dict(data)
    for a, b in zip(record.layers, back.layers):
        assert (a.heads, a.rows) == (b.heads, b.rows) == ((2,), (1, 2))
        torch.testing.assert_close(a.weights, b.weights, rtol=0, atol=1e-6)


def test_the_views_and_roles_refuse_a_partial_record(tmp_path):
    model = ThreeLayers().eval()
    with torch.no_grad(), capture(model, heads=[0]) as record:
        model(torch.randn(1, 4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"layer 0 \(blocks.0\) holds heads \[0\] only; the views need every head"):
        write_html(record, tmp_path / "heads.html")
    with pytest.raises(ValueError, match=r"holds heads \[0\] only; classify_heads need every head"):
        classify_heads(record)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("kw", "error", "match"), [
    ({"layers": [3]}, ValueError, r"layers=\[3\] asks for layer 3, but the model has 3 attention modules"),
    ({"layers": [2, 1]}, ValueError, r"layers must be ascending layer indices.*layers=\[2, 1\]"),
    ({"layers": []}, ValueError, r"at least one"),
    ({"layers": 1}, TypeError, r"layers must be a list of ints, got layers=1"),
    ({"heads": [1, 0]}, ValueError, r"heads=\[1, 0\]"),
    ({"rows": [0.5]}, TypeError, r"rows must hold ints, got 0.5"),
])
def test_bad_options_are_refused_before_anything_is_observed(kw, error, match):
    model = ThreeLayers()
    with pytest.raises(error, match=match):
        with capture(model, **kw):
            pass
    assert not any(m.observed for _, m in attention_modules(model))


def test_a_head_beyond_a_layer_is_named_at_the_call():
    model = ThreeLayers().eval()
    with pytest.raises(ValueError, match=r"heads=\[4\] asks for head 4, but the call has H=4"):
        with torch.no_grad(), capture(model, heads=[4]):
            model(torch.randn(1, 3, 8, dtype=torch.float64))
    assert not any(m.observed for _, m in attention_modules(model))


def test_scores_of_a_kind_with_more_query_heads_than_weights():
    """Differential attention scores 2H sub-heads and mixes with H weights: its scores
    keep every sub-head, for the rows asked for."""
    torch.manual_seed(0)
    m = build_attention("diff", embed_dim=16, num_heads=2, dtype=torch.float64).eval()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    with torch.no_grad(), capture(m, scores=True) as full:
        m(x, is_causal=True)
    with torch.no_grad(), capture(m, scores=True, rows=[1, 4]) as part:
        m(x, is_causal=True)
    whole, entry = full.layers[0], part.layers[0]
    assert whole.weights.shape == (1, 2, 5, 5) and whole.scores.shape == (1, 4, 5, 5)
    assert entry.rows == (1, 4) and entry.scores.shape == (1, 4, 2, 5)
    assert torch.equal(torch.isneginf(entry.scores), torch.isneginf(whole.scores[:, :, [1, 4]]))
    finite = ~torch.isneginf(entry.scores)
    assert_paths_agree(entry.scores[finite], whole.scores[:, :, [1, 4]][finite])
    assert_paths_agree(entry.weights, whole.weights[:, :, [1, 4]])
