"""``multihead compare``'s cost columns for a base model with local and global layers: every
block counted with its own window (``train.compare_plan``)."""

from __future__ import annotations

from multihead.functional import causal_mask, sliding_window_mask
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.flops import kv_cache_size
from multihead.train.compare_plan import plan_kind

W = 16


def test_local_layers_cost_their_window_in_the_flops_columns_and_a_full_cache_in_the_kv_column():
    """catches: block 0's window counted in every block (or none)."""
    glob = GPTConfig.from_preset("mini")
    local = GPTConfig.from_dict({**glob.to_dict(), "layer_attention_options": [{"window": W}, {}]})  # blocks 0, 2
    a, b = plan_kind(glob, "mha"), plan_kind(local, "mha")
    C, T = glob.embed_dim, glob.context_length
    # MHA's core: 2 FLOPs x H heads x (scores + mixing: 2D) per visible pair = 4C per pair
    decode_pairs = T - W  # per local block, a decode query sees W keys of T
    assert a.decode_flops_per_token - b.decode_flops_per_token == 2 * 4 * C * decode_pairs
    prefill_pairs = int(causal_mask(T, T).sum()) - int(sliding_window_mask(T, window=W).sum())
    assert (a.prefill_flops_per_token - b.prefill_flops_per_token) * T == 2 * 4 * C * prefill_pairs
    # the KV column: the bytes of one cached position in every block, window or not (the
    # global model's caches allocate exactly that per position); a local block's cache holds
    # at most its last W positions of it (kv_cache_size's bytes at a context)
    assert b.kv_cache_bytes_per_token == a.kv_cache_bytes_per_token == sum(
        sum(buf.nbytes for buf in cache.buffers()) for cache in GPT(glob).make_kv_caches(1, 8)
    ) // 8
    assert kv_cache_size(GPT(local), context=T).bytes == a.kv_cache_bytes_per_token * (2 * W + 2 * T) // 4  # 4 blocks
