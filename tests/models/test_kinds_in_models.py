"""Every attention kind runs inside the encoder-decoder and the BERT encoder by name."""

from __future__ import annotations

import pytest
import torch
from support.paths import assert_greedy_agrees

from multihead import list_attention_kinds
from multihead.models import BertConfig, BertEncoder, Transformer, TransformerConfig

OPTIONS = {"gqa": {"num_kv_heads": 2}}


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_transformer_cached_greedy_equals_uncached(kind):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.from_preset("copy-task", attention=kind, **OPTIONS.get(kind, {}))).eval()
    src = torch.tensor([[3, 4, 5, 6, 2], [7, 8, 2, 0, 0]])
    pad = src != 0
    kw = {"src_key_mask": pad, "return_logits": True}
    cached, logits = model.greedy_decode(src, max_len=7, use_cache=True, **kw)
    uncached, ref_logits = model.greedy_decode(src, max_len=7, use_cache=False, **kw)
    assert_greedy_agrees(cached, uncached, logits, ref_logits, start=1)


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_bert_encoder_ignores_padding(kind):
    torch.manual_seed(0)
    model = BertEncoder(BertConfig.from_preset("bert-tiny", attention=kind, **OPTIONS.get(kind, {}))).eval()
    ids = torch.tensor([[101, 2023, 2003, 102, 0, 0]])
    mask = (ids != 0).long()
    padded = model(ids, attention_mask=mask)[:, :4]
    alone = model(ids[:, :4])
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-5)
