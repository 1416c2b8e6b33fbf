"""tools.roofline: a GPT's prefill and decode FLOPs equal torch's FlopCounterMode
on the real model for every kind (Mixture-of-Head aside: its routed work
depends on the routing); bytes, intensity and the bound follow their definitions."""

from __future__ import annotations

import pytest
import torch
from support.kinds import uncounted_flops
from torch.utils.flop_counter import FlopCounterMode

from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.registry import attention_class, list_attention_kinds
from multihead.tools.roofline import bound, floor_seconds, phase_costs

KINDS = [k for k in list_attention_kinds() if k != "moh"]


def _math_backend(model: GPT) -> GPT:
    """Every attention call on the math backend, whose products the flop counter sees (CPU SDPA is not counted)."""
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda m, args, kwargs: (args, {**kwargs, "backend": "math"}),
                                             with_kwargs=True)  # fmt: skip
    return model


def _config(kind: str) -> GPTConfig:
    options = attention_class(kind).comparison_options(kind, 4)
    return GPTConfig.from_preset("tiny", vocab_size=37, context_length=16, num_layers=2, attention=kind,
                                 attention_options=options)  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_decode_flops_equal_the_flop_counter_on_a_cached_step(kind):
    """One new token over a cache of S = 6: projections of the new token only, the core over 7 keys."""
    config = _config(kind)
    torch.manual_seed(0)
    model = _math_backend(GPT(config, dtype=torch.float64).eval())
    B, S = 2, 6
    idx = torch.randint(0, 37, (B, S + 1), generator=torch.Generator().manual_seed(1))
    caches = model.make_kv_caches(B, S + 1)
    with torch.no_grad():
        model(idx[:, :S], kv_caches=caches)
        with FlopCounterMode(display=False) as counter:
            model(idx[:, S:], kv_caches=caches)
    cost = phase_costs(config, batch=B, context=S)["decode"]
    attn = model.blocks[0].attn
    assert counter.get_total_flops() == cost.total_flops - config.num_layers * uncounted_flops(attn, B, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_flops_equal_the_flop_counter_less_the_hidden_pairs(kind):
    """The math backend multiplies every (query, key) pair; the count leaves out the causally hidden ones."""
    config = _config(kind)
    model = _math_backend(GPT(config, dtype=torch.float64).eval())
    B, T = 2, 5
    idx = torch.randint(0, 37, (B, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(idx)
    cost = phase_costs(config, batch=B, context=T)["prefill"]
    attn = model.blocks[0].attn
    hidden = attn.cost(T, batch=B).core_flops - attn.cost(T, batch=B, causal=True).core_flops
    want = cost.total_flops + config.num_layers * (hidden - uncounted_flops(attn, B, T))
    assert counter.get_total_flops() == want


def test_bytes_intensity_and_bound():
    config = GPTConfig.from_preset("gpt2-small")
    costs = phase_costs(config, batch=1, context=1024, bytes_per_element=4)
    prefill, decode = costs["prefill"], costs["decode"]
    params = GPT(config, device="meta").num_parameters()
    assert prefill.bytes["weights"] == params * 4  # tied: the LM head reads the table; all 1024 position rows
    assert decode.bytes["weights"] == (params - 1023 * 768) * 4  # one new token: one row of the position table
    kv = 12 * 2 * 768 * 4  # layers x (k, v) x C x 4 bytes
    assert prefill.kv_cache_bytes_per_token == kv
    assert decode.bytes["kv cache read"] == 1024 * kv and decode.bytes["kv cache written"] == kv
    assert prefill.bytes["kv cache read"] == 0 and prefill.bytes["kv cache written"] == 1024 * kv
    assert prefill.intensity == prefill.total_flops / prefill.total_bytes
    # one decode step reads every weight for about 2 FLOPs per parameter: memory-bound anywhere
    assert decode.intensity < 1 and prefill.intensity > 100
    peak, bandwidth = 100e9, 20e9  # ridge point 5 FLOP/byte
    assert (bound(prefill, peak, bandwidth), bound(decode, peak, bandwidth)) == ("compute", "memory")
    assert floor_seconds(decode, peak, bandwidth) == decode.total_bytes / bandwidth
    assert floor_seconds(prefill, peak, bandwidth) == prefill.total_flops / peak


def test_arguments_are_checked():
    config = GPTConfig.from_preset("tiny")
    with pytest.raises(ValueError, match="context=129 exceeds the model's context_length=128"):
        phase_costs(config, context=129)
    with pytest.raises(ValueError, match="batch must be a positive int, got 0"):
        phase_costs(config, batch=0)
