"""parallel.costs.rank_cost for a GPT whose blocks differ: each block's share is its own layer's."""

from __future__ import annotations

import pytest

from multihead.models.gpt import GPT, GPTConfig
from multihead.parallel.costs import rank_cost
from multihead.tools.flops import kv_cache_size


def _config(layer_heads):
    return GPTConfig.from_preset("tiny", vocab_size=50, context_length=16, num_layers=3, layer_heads=layer_heads,
                                 layer_attention_options=[{"window": 4}, {}])  # fmt: skip


def test_one_ranks_share_sums_each_blocks_own_heads():
    """catches: block 0's 4 heads counted in the pruned blocks of 2."""
    config = _config([4, 2, 2])
    C, D, M = config.embed_dim, config.embed_dim // config.num_heads, 4 * config.embed_dim
    whole = GPT(config, device="meta")
    one = rank_cost(config, 1, bytes_per_element=4)
    assert one.parameters == whole.num_parameters()
    assert one.kv_cache_bytes_per_token == kv_cache_size(GPT(config)).bytes_per_token
    share = rank_cost(config, 2, bytes_per_element=4)
    replicated = whole.num_parameters() - sum(sum(p.numel() for p in b.parameters()) for b in whole.blocks)
    per_block = []
    for h in (2, 1, 1):  # each block's heads on one rank of two
        attention = C * 3 * h * D + 3 * h * D + h * D * C + C  # qkv rows and bias, out_proj columns, its bias
        mlp = (C * M + M) // 2 + M * C // 2 + C
        per_block.append(attention + mlp + 4 * C)  # + ln_1, ln_2
    assert share.parameters == replicated + sum(per_block)
    assert share.kv_cache_bytes_per_token == sum(2 * h * D * 4 for h in (2, 1, 1))


def test_a_block_whose_heads_do_not_split_is_named():
    with pytest.raises(ValueError, match=r"block 2: tensor parallelism of degree 2 needs the head count to divide"):
        rank_cost(_config([4, 2, 1]), 2)


def test_alibi_blocks_are_cut_on_the_meta_device_with_their_heads_slopes():
    """catches: reading the slopes of a layer built on the meta device (no data) to keep a rank's heads."""
    from multihead import build_attention

    alibi = GPTConfig.from_dict({**_config([4, 2, 2]).to_dict(), "positions": "alibi"})
    none = GPTConfig.from_dict({**alibi.to_dict(), "positions": "none"})
    assert rank_cost(alibi, 2) == rank_cost(none, 2)  # the slopes are no parameters
    real = build_attention("mha", embed_dim=64, num_heads=4, alibi=True)
    meta = build_attention("mha", embed_dim=64, num_heads=4, alibi=True, device="meta")
    want = real.alibi_slopes[2:].tolist()
    assert meta.tensor_parallel_part([2, 3]).init_options["alibi"] == want == real.tensor_parallel_part([2, 3]).init_options["alibi"]
