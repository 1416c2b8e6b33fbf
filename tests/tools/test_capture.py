"""Capturing attention weights through observers."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention
from multihead.tools import AttentionRecord, attention_modules, capture


class TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            [MultiHeadAttention(8, 2, dtype=torch.float64), MultiHeadAttention(8, 4, num_kv_heads=2, dtype=torch.float64)]
        )

    def forward(self, x, causal=False):
        for block in self.blocks:
            x = x + block(x, is_causal=causal)
        return x


def test_capture_records_every_layer_in_model_order():
    model = TwoLayers().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    with capture(model) as record:
        y = model(x, causal=True)
    torch.testing.assert_close(y, model(x, causal=True), rtol=0, atol=1e-12)
    assert [e.layer for e in record.layers] == [0, 1]
    assert [e.name for e in record.layers] == ["blocks.0", "blocks.1"]
    assert [e.kind for e in record.layers] == ["mha", "gqa"]
    assert record.layers[1].weights.shape == (2, 4, 5, 5) and record.layers[1].weights.dtype == torch.float32
    # the recorded weights are the module's exact weights
    _, w0 = model.blocks[0](x, is_causal=True, return_weights=True)
    torch.testing.assert_close(record.layers[0].weights, w0.float())
    assert torch.equal(record.head(0, 1, batch=1), record.layers[0].weights[1, 1])


def test_nothing_is_observed_outside_the_block_even_after_an_error():
    model = TwoLayers()
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model):
            raise RuntimeError("boom")
    assert not any(m.observed for _, m in attention_modules(model))


def test_scores_are_pre_softmax_with_minus_inf_where_hidden():
    model = TwoLayers().eval()
    with capture(model, scores=True) as record:
        model(torch.randn(1, 4, 8, dtype=torch.float64), causal=True)
    for entry in record.layers:
        assert torch.isneginf(entry.scores[0, :, 0, 1:]).all()  # causal: query 0 sees key 0 only
        torch.testing.assert_close(torch.softmax(entry.scores, dim=-1), entry.weights, rtol=0, atol=1e-6)


def test_json_round_trip_and_atomic_save(tmp_path):
    model = TwoLayers().eval()
    with capture(model, scores=True) as record:
        model(torch.randn(1, 3, 8, dtype=torch.float64), causal=True)
    record.query_tokens = ["a", "<b>", "c\"d"]
    path = record.save_json(tmp_path / "heads.json")
    data = json.loads(path.read_text())
    assert data["key_tokens"] == record.query_tokens
    back = AttentionRecord.from_dict(data)
    for a, b in zip(record.layers, back.layers):
        torch.testing.assert_close(a.weights, b.weights, rtol=0, atol=1e-6)
        assert torch.equal(torch.isneginf(a.scores), torch.isneginf(b.scores))
    assert [p.name for p in tmp_path.iterdir()] == ["heads.json"]  # no temporary left behind


def test_errors():
    with pytest.raises(ValueError, match="contains no multihead attention module"):
        with capture(nn.Linear(2, 2)):
            pass
    record = AttentionRecord()
    with pytest.raises(IndexError, match=r"layer 0 out of range \[0, 0\)"):
        record.head(0, 0)
    with pytest.raises(ValueError, match="not an attention record"):
        AttentionRecord.from_dict({"weights": []})


def test_a_module_on_its_own_and_every_generation_step():
    m = MultiHeadAttention(8, 2, dtype=torch.float64).eval()
    cache = m.make_kv_cache(1, 4)
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    with capture(m) as record:
        m(x[:, :2], is_causal=True, kv_cache=cache)
        m(x[:, 2:3], is_causal=True, kv_cache=cache)
    assert [e.weights.shape[-2:] for e in record.layers] == [(2, 2), (1, 3)]
    assert record.layers[0].name == "MultiHeadAttention"
