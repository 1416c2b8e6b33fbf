"""Every attention kind runs inside the encoder-decoder and the BERT encoder by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support.paths import assert_greedy_agrees
from support.properties import examples

from multihead import list_attention_kinds
from multihead.models import BertConfig, BertEncoder, Transformer, TransformerConfig
from multihead.modules.registry import kind_options

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


SCORE_OPTIONS = ({"rope": True}, {"alibi": True}, {"softcap": 20.0}, {"sinks": True}, {"qk_norm": True})


@settings(max_examples=examples(12), deadline=None)
@given(kind=st.sampled_from(list_attention_kinds()), picks=st.lists(st.sampled_from(SCORE_OPTIONS), max_size=3),
       src_len=st.integers(1, 9), seed=st.integers(0, 2**16))  # fmt: skip
def test_transformer_cached_greedy_equals_uncached_with_the_kinds_options(kind, picks, src_len, seed):
    """Any kind with any of the shared score options it takes: cached decoding follows the uncached one
    (the cross-attention layers are built without the positional ones)."""
    accepted = kind_options(kind)
    options = {k: v for pick in picks for k, v in pick.items() if accepted is None or k in accepted}
    torch.manual_seed(seed)
    config = TransformerConfig.from_preset("copy-task", attention=kind, attention_options=options,
                                           **OPTIONS.get(kind, {}))  # fmt: skip
    model = Transformer(config).eval()
    src = torch.randint(3, 11, (2, src_len), generator=torch.Generator().manual_seed(seed))
    pad = torch.ones_like(src, dtype=torch.bool)
    pad[1, src_len // 2 + 1 :] = False  # the second row padded
    kw = {"src_key_mask": pad, "return_logits": True}
    cached, logits = model.greedy_decode(src, max_len=6, use_cache=True, **kw)
    uncached, ref_logits = model.greedy_decode(src, max_len=6, use_cache=False, **kw)
    assert_greedy_agrees(cached, uncached, logits, ref_logits, start=1)
