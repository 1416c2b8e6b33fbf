"""The head explorer's capture works for every attention kind, inside a model."""

from __future__ import annotations

import pytest
import torch

from multihead import list_attention_kinds
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import capture, classify_heads, write_html

OPTIONS = {"gqa": {"num_kv_heads": 2}, "overlapping": {"overlap": 2}}


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_every_kind_is_captured_in_a_gpt(kind, tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig.from_preset("tiny", attention=kind, num_layers=2, attention_options=OPTIONS.get(kind, {}))
    model = GPT(cfg).eval()
    ids = torch.tensor([list(b"heads!")])
    plain = model(ids)
    with torch.no_grad(), capture(model) as record:
        observed = model(ids)
    torch.testing.assert_close(observed, plain, rtol=1e-5, atol=1e-5)
    assert [e.layer for e in record.layers] == [0, 1]
    assert all(e.kind == kind for e in record.layers)
    for entry in record.layers:
        assert entry.weights.shape == (1, cfg.num_heads, 6, 6)
        assert torch.isfinite(entry.weights).all()
        assert (entry.weights[0, :, 0, 1:] == 0).all()  # causal: token 0 mixes only itself
    record.query_tokens = [chr(b) for b in b"heads!"]
    roles = classify_heads(record)
    assert len(roles) == 2 * cfg.num_heads
    assert write_html(record, tmp_path / "heads.html", roles=roles).stat().st_size > 1000
