"""tools.roofline and the KV-cache size of models whose blocks differ: local (window) and global
layers, per-layer heads, positions without a table. Every block is counted with its own layer.

FLOPs are checked against torch's FlopCounterMode on the real model. The math backend multiplies
every (query, key) pair, the masked ones too, while the roofline counts the visible pairs only (as
a fused windowed kernel computes them); so the counter is compared with the roofline's count in
which each block's core is replaced by the dense core of the same block without its window, and
each block's counted core is checked to be that dense core less the work of the pairs its mask
hides (counted from the mask builders). A decode step over the caches ``make_kv_caches`` builds
multiplies only the keys a local block's window cache keeps, all visible: there the counter
sees the roofline's count of that block (a kind with a cache of its own keeps every key)."""

from __future__ import annotations

import pytest
import torch
from support.kinds import uncounted_flops
from torch.utils.flop_counter import FlopCounterMode

from multihead.functional import causal_mask, sliding_window_mask
from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.registry import attention_class, list_attention_kinds
from multihead.tools.flops import kv_cache_size
from multihead.tools.roofline import phase_costs

KINDS = [k for k in list_attention_kinds() if k != "moh"]  # moh: its routed work depends on the routing
W = 3  # the local layers' window
LOCAL_GLOBAL = [{"window": W}, {}]  # blocks 0 and 2 local, block 1 global


def _math_backend(model: GPT) -> GPT:
    """Every attention call on the math backend, whose products the flop counter sees."""
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda m, args, kwargs: (args, {**kwargs, "backend": "math"}),
                                             with_kwargs=True)  # fmt: skip
    return model


def _config(kind: str, **fields) -> GPTConfig:
    options = attention_class(kind).comparison_options(kind, 4)
    return GPTConfig.from_preset("tiny", vocab_size=37, context_length=16, num_layers=3, attention=kind,
                                 attention_options=options, layer_attention_options=LOCAL_GLOBAL, **fields)  # fmt: skip


def _windowless(config: GPTConfig) -> GPT:
    """The same blocks without their windows (heads, options and sizes kept), on the meta device."""
    options = [{k: v for k, v in d.items() if k != "window"} for d in config.layer_attention_options]
    return GPT(GPTConfig.from_dict({**config.to_dict(), "layer_attention_options": options}), device="meta")


def _visible(T: int, S: int, window: int | None) -> int:
    """Pairs the block's mask keeps: T queries at the last T of S positions (a prefill: T = S)."""
    if window is None:
        return int(causal_mask(T, S, alignment="bottom_right").sum())
    return int(sliding_window_mask(T, S, window=window, alignment="bottom_right").sum())


def _check_against_counter(config: GPTConfig, phase: str, counted_flops: int, B: int, T: int, S: int) -> None:
    cost = phase_costs(config, batch=B, context=T if phase == "prefill" else S - 1)[phase]
    twin = _windowless(config)
    dense = [block.attn.cost(T, S, batch=B).core_flops for block in twin.blocks]  # every pair, as the math path
    windows = [block.attn.sliding_window for block in GPT(config, device="meta").blocks]
    assert [b.window for b in cost.blocks] == windows and windows[0] == windows[2] == W and windows[1] is None
    # a kind's core is a · (visible pairs) + b: two points of the windowless block fix a, and the
    # counted core is the dense one less a · (the pairs the block's mask hides)
    top_left = int(causal_mask(T, S).sum())
    causal = [block.attn.cost(T, S, batch=B, causal=True).core_flops for block in twin.blocks]  # top-left pairs
    for block, full, fewer in zip(cost.blocks, dense, causal, strict=True):
        hidden = T * S - _visible(T, S, block.window)
        assert (full - block.core_flops) * (T * S - top_left) == (full - fewer) * hidden, block
    uncounted = sum(uncounted_flops(b.attn, B, T) for b in twin.blocks)
    if phase == "decode":  # a bounded (window) cache returns exactly the keys its query sees
        dense = [b.core_flops if b.kv_cache_positions < S else d for b, d in zip(cost.blocks, dense)]
    assert counted_flops == cost.total_flops - sum(b.core_flops for b in cost.blocks) + sum(dense) - uncounted


@pytest.mark.parametrize("kind", KINDS)
def test_local_and_global_layers_prefill_and_decode_flops_equal_the_flop_counter(kind):
    """catches: block 0's window counted in every block, or a decode query's window counted top-left (1 key)."""
    config = _config(kind)
    torch.manual_seed(0)
    model = _math_backend(GPT(config, dtype=torch.float64).eval())
    B, T, S = 2, 5, 6  # prefill of 5 tokens; one decode step over 6 cached
    idx = torch.randint(0, 37, (B, S + 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(idx[:, :T])
    _check_against_counter(config, "prefill", counter.get_total_flops(), B, T, T)
    caches = model.make_kv_caches(B, S + 1)
    with torch.no_grad():
        model(idx[:, :S], kv_caches=caches)
        with FlopCounterMode(display=False) as counter:
            model(idx[:, S:], kv_caches=caches)
    _check_against_counter(config, "decode", counter.get_total_flops(), B, 1, S + 1)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_per_layer_heads_and_windows_equal_the_flop_counter(positions):
    """catches: block 0's heads (4 query, 2 key/value) counted for the pruned blocks."""
    config = _config("gqa", num_kv_heads=2, layer_heads=[4, 2, 1], layer_kv_heads=[2, 1, 1], positions=positions)
    model = _math_backend(GPT(config, dtype=torch.float64).eval())
    assert [b.attn.num_heads for b in model.blocks] == [4, 2, 1]
    B, T = 2, 6
    idx = torch.randint(0, 37, (B, T + 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(idx[:, :T])
    _check_against_counter(config, "prefill", counter.get_total_flops(), B, T, T)
    caches = model.make_kv_caches(B, T + 1)
    with torch.no_grad():
        model(idx[:, :T], kv_caches=caches)
        with FlopCounterMode(display=False) as counter:
            model(idx[:, T:], kv_caches=caches)
    _check_against_counter(config, "decode", counter.get_total_flops(), B, 1, T + 1)
    assert [b.heads for b in phase_costs(config, context=T)["decode"].blocks] == [4, 2, 1]


def test_kv_cache_bytes_are_what_each_blocks_cache_holds():
    """After a prefill of ``context`` tokens and one decode step, a global block's cache
    allocates its context + 1 positions and a local block's holds its last W (window_cache):
    the bytes of every cache tensor are the roofline's ``kv_cache_bytes`` and
    ``kv_cache_size``'s at context + 1; a decode step reads a local block's last W - 1
    positions and a global one's all. catches: a local block counted at every position."""
    config = _config("gqa", num_kv_heads=2, layer_heads=[4, 2, 4], layer_kv_heads=[2, 1, 1])
    model = GPT(config).eval()  # float32
    B, context = 3, 8
    caches = model.make_kv_caches(B, context + 1)
    idx = torch.randint(0, 37, (B, context + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(idx[:, :context], kv_caches=caches)
        model(idx[:, context:], kv_caches=caches)
    held = [sum(t.untyped_storage().nbytes() for t in (c.k, c.v)) for c in caches]  # every byte the caches keep
    per_token = [2 * 2 * 16 * 4, 2 * 1 * 16 * 4, 2 * 1 * 16 * 4]  # (k, v) x G x D x 4 bytes
    assert held == [B * W * per_token[0], B * (context + 1) * per_token[1], B * W * per_token[2]]
    decode = phase_costs(config, batch=B, context=context, bytes_per_element=4)["decode"]
    assert decode.kv_cache_bytes == sum(held)
    assert [b.kv_cache_positions for b in decode.blocks] == [W, context + 1, W]
    assert [b.kv_cache_bytes_per_token for b in decode.blocks] == per_token
    size = kv_cache_size(model, context=context + 1)
    assert size.bytes_per_token == decode.kv_cache_bytes_per_token == sum(per_token) and B * size.bytes == sum(held)
    assert str(size) == f"{sum(per_token)} bytes/token (float32); {size.bytes} bytes per sequence at 9 positions " \
        "(local layers hold their window)"
    read = B * ((W - 1) * per_token[0] + context * per_token[1] + (W - 1) * per_token[2])
    assert decode.bytes["kv cache read"] == read and decode.bytes["kv cache written"] == B * sum(per_token)


@pytest.mark.parametrize("positions", ["learned", "rope", "alibi", "none"])
def test_weight_bytes_hold_the_position_table_only_when_learned(positions):
    """Every parameter read once (tied LM head: the whole token table), the learned position
    table only at the rows of the positions looked up, and no table for the others."""
    config = GPTConfig.from_preset("tiny", context_length=16, layer_attention_options=LOCAL_GLOBAL, positions=positions)
    model = GPT(config, device="meta")
    params = model.num_parameters()
    table = 16 * config.embed_dim if positions == "learned" else 0
    assert (model.position_embedding is not None) == (positions == "learned")
    costs = phase_costs(config, context=10, bytes_per_element=2)
    assert costs["prefill"].bytes["weights"] == (params - table + table // 16 * 10) * 2
    assert costs["decode"].bytes["weights"] == (params - table + table // 16) * 2
