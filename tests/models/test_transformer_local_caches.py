"""An encoder-decoder whose decoder self-attention layers have a window decodes over a
window cache per such layer (``Transformer.make_kv_caches``): a prefill longer than
the window then one-token steps give the full decode, greedy decoding gives the
uncached tokens, each window cache holds its window while the global layer and the
cross-attention caches hold everything."""

from __future__ import annotations

import torch
from support.paths import assert_greedy_agrees, assert_paths_agree

from multihead import KVCache, WindowKVCache
from multihead.models.copy_task import copy_task_batches
from multihead.models.transformer import Transformer, TransformerConfig, transformer_attention

WINDOW = 3


def _model(attention="gqa", num_kv_heads=2, **overrides) -> Transformer:
    """Three decoder layers: 0 and 2 local (window 3), 1 global."""
    torch.manual_seed(0)
    config = TransformerConfig.from_preset("copy-task", attention=attention, num_kv_heads=num_kv_heads, num_decoder_layers=3, embed_dim=32,
                                           ffn_dim=64, **overrides)  # fmt: skip
    model = Transformer(config)
    for i in (0, 2):
        model.decoder[i].self_attn = transformer_attention(config, "decoder", i, window=WINDOW)
    return model.eval()


def _batch():
    return next(copy_task_batches(1, 3, 10, 11, min_len=4, generator=torch.Generator().manual_seed(2)))


def test_make_kv_caches_bounds_the_local_decoder_layers_only():
    model, b = _model(), _batch()
    caches = model.make_kv_caches(3, 12)
    assert [type(c) for c in caches.self_attn] == [WindowKVCache, KVCache, WindowKVCache]
    memory = model.encode(b.src, b.src_key_mask)
    with torch.no_grad():
        model.decode(b.tgt[:, :7], memory, src_key_mask=b.src_key_mask, kv_caches=caches)
        model.decode(b.tgt[:, 7:8], memory, src_key_mask=b.src_key_mask, kv_caches=caches)
    D = model.config.head_dim
    for i in (0, 2):
        c = caches[i]
        assert c.length == 8 and c.k.shape == c.v.shape == (3, 2, WINDOW, D)
    assert caches[1].length == 8 and caches[1].k.shape == (3, 2, 12, D)
    assert all(type(c) is KVCache and c.k.shape[2] == b.src.shape[1] for c in caches.cross)


def test_a_prefill_longer_than_the_window_then_steps_equal_the_full_decode():
    """Target padding included: the key mask over every target position is cut to the kept keys."""
    model, b = _model(), _batch()
    T = b.tgt.shape[1]
    with torch.no_grad():
        memory = model.encode(b.src, b.src_key_mask)
        want = model.decode(b.tgt, memory, src_key_mask=b.src_key_mask, tgt_key_mask=b.tgt_key_mask)
        caches = model.make_kv_caches(3, T)
        got = [model.decode(b.tgt[:, :6], memory, src_key_mask=b.src_key_mask, tgt_key_mask=b.tgt_key_mask[:, :6],
                            kv_caches=caches)]  # fmt: skip
        for t in range(6, T):
            got.append(model.decode(b.tgt[:, t : t + 1], memory, src_key_mask=b.src_key_mask,
                                    tgt_key_mask=b.tgt_key_mask[:, : t + 1], kv_caches=caches))  # fmt: skip
    got = torch.cat(got, 1)
    real = b.tgt_key_mask  # padded target queries see only padding: not compared
    assert_paths_agree(got[real], want[real])
    assert caches[0].k.shape[2] == WINDOW


def test_greedy_decoding_over_window_caches_equals_no_cache():
    model, b = _model(attention="mha", num_kv_heads=None), _batch()
    kw = {"src_key_mask": b.src_key_mask, "return_logits": True}
    tokens, logits = model.greedy_decode(b.src, 10, **kw)
    ref, ref_logits = model.greedy_decode(b.src, 10, use_cache=False, **kw)
    assert_greedy_agrees(tokens, ref, logits, ref_logits, start=1)
