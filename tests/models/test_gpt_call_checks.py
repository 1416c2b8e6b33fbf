"""GPT.forward refuses ids and positions of the wrong dtype, and a call that
fails on its caches leaves every cache as it was (the blocks before the
failing one included)."""

import re

import pytest
import torch

from multihead.models import GPT, GPTConfig
from multihead.modules import KVCache


def _model(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=61, context_length=32, embed_dim=32, num_layers=3, num_heads=4)
    return GPT(GPTConfig(**{**config, **overrides})).eval()


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.bool, torch.float32])
def test_ids_of_other_dtypes_raise_type_error(dtype):
    model = _model()
    with pytest.raises(TypeError, match=re.escape(f"got dtype {dtype}")):
        model(torch.zeros(1, 3, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_int64_and_int32_ids_and_positions_give_the_same_logits(dtype):
    model = _model()
    idx = torch.tensor([[3, 1, 4, 1, 5]])
    pos = torch.arange(5)[None]
    want = model(idx)
    # the same embedding rows are gathered whatever the index dtype
    assert torch.equal(model(idx.to(dtype), position_ids=pos.to(dtype)), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.uint8, torch.bool])
def test_position_ids_of_other_dtypes_raise_type_error(dtype):
    model = _model()
    with pytest.raises(TypeError, match=re.escape(f"position_ids must be integer positions, got dtype {dtype}")):
        model(torch.zeros(1, 3, dtype=torch.long), position_ids=torch.zeros(1, 3, dtype=dtype))


def test_position_ids_out_of_range_name_the_values():
    model = _model()
    with pytest.raises(ValueError, match=r"position_ids must be in \[0, 32\), got min 0, max 32"):
        model(torch.zeros(1, 2, dtype=torch.long), position_ids=torch.tensor([[0, 32]]))


def _snapshot(caches):
    return [(c.length, c.k.clone(), c.v.clone()) for c in caches]


def _assert_unchanged(caches, snapshot):
    for i, (cache, (length, k, v)) in enumerate(zip(caches, snapshot)):
        assert cache.length == length, f"cache {i}: length {cache.length} != {length}"
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v), f"cache {i} was written"


def _prefilled(model, B=2):
    caches = model.make_kv_caches(B, 8)
    model(torch.randint(0, 61, (B, 3), generator=torch.Generator().manual_seed(1)), kv_caches=caches)
    return caches


def test_caches_of_different_lengths_are_refused_before_any_write():
    model = _model()
    caches = _prefilled(model)
    caches[2].length = 2  # the last block's cache is one position behind
    before = _snapshot(caches)
    with pytest.raises(ValueError, match=r"same length, got lengths \[3, 3, 2\]"):
        model(torch.zeros(2, 1, dtype=torch.long), kv_caches=caches)
    _assert_unchanged(caches, before)


def test_a_cache_of_another_batch_size_is_refused_before_any_write():
    model = _model()
    caches = _prefilled(model)
    caches[1] = model.blocks[1].attn.make_kv_cache(1, 8)  # batch 1 among batch-2 caches
    caches[1].length = 3
    before = _snapshot(caches)
    with pytest.raises(ValueError, match="KV cache of block 1: KV cache holds batch_size=1, got a batch of 2"):
        model(torch.zeros(2, 1, dtype=torch.long), kv_caches=caches)
    _assert_unchanged(caches, before)


def test_a_cache_without_room_is_refused_before_any_write():
    model = _model()
    caches = _prefilled(model)
    caches[2] = model.blocks[2].attn.make_kv_cache(2, 4)
    caches[2].length = 3
    before = _snapshot(caches)
    msg = "KV cache of block 2: KV cache overflow: 3 cached + 2 new = 5 > max_len 4"
    with pytest.raises(ValueError, match=re.escape(msg)):
        model(torch.zeros(2, 2, dtype=torch.long), kv_caches=caches)
    _assert_unchanged(caches, before)


def test_a_failure_inside_a_later_block_rolls_every_cache_back():
    """A cache of the wrong head layout fails only when block 2 writes to it;
    the caches of blocks 0 and 1 were written by then and are rolled back, so
    decoding afterwards gives the logits of a run without the failed call."""
    model = _model()
    caches = _prefilled(model)
    reference = _prefilled(model)
    good = caches[2]
    caches[2] = KVCache(2, 1, 8, model.config.head_dim)  # 1 key/value head instead of 4
    caches[2].length = 3
    lengths = [c.length for c in caches]
    prefixes = [(c.k[:, :, :3].clone(), c.v[:, :, :3].clone()) for c in caches]
    nxt = torch.tensor([[5], [9]])
    with pytest.raises(ValueError, match=r"cache holds k \(B=2, G=1, D=8\)"):
        model(nxt, kv_caches=caches)
    assert [c.length for c in caches] == lengths
    for c, (k, v) in zip(caches, prefixes):
        assert torch.equal(c.k[:, :, :3], k) and torch.equal(c.v[:, :, :3], v)
    caches[2] = good
    torch.testing.assert_close(model(nxt, kv_caches=caches), model(nxt, kv_caches=reference))
