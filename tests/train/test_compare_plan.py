"""How ``multihead compare`` sizes and measures each kind (``train.compare_plan``)
and turns a time budget into steps (``train.compare.steps_for_budget``)."""

from __future__ import annotations

import pytest
import torch

from multihead import MultiHeadAttention, list_attention_kinds
from multihead.models.gpt import GPT, GPTConfig
from multihead.modules import registry
from multihead.train.compare import CompareConfig, steps_for_budget
from multihead.train.compare_plan import MATCH_TOLERANCE, default_kinds, parse_kinds, plan_kind

BASE = GPTConfig.from_preset("mini")


def test_the_default_list_is_every_registered_kind_mha_first():
    assert default_kinds()[0] == "mha" and sorted(default_kinds()) == list_attention_kinds()
    assert CompareConfig().kinds == default_kinds()


def test_a_kind_registered_later_joins_the_default_list_unless_it_opts_out():
    class Skipped(MultiHeadAttention):
        comparison_skip = "a test kind that is never compared"

    registry.register_attention("joins_compare_for_test", MultiHeadAttention)(lambda **kw: MultiHeadAttention(**kw))
    registry.register_attention("skips_compare_for_test")(Skipped)
    try:
        assert "joins_compare_for_test" in default_kinds() and "skips_compare_for_test" not in default_kinds()
        assert "joins_compare_for_test" in CompareConfig().kinds
    finally:
        registry._KINDS.pop("joins_compare_for_test")
        registry._KINDS.pop("skips_compare_for_test")


@pytest.mark.parametrize("kind", default_kinds())
def test_every_kind_is_matched_to_the_mha_parameter_count(kind):
    plan = plan_kind(BASE, kind)
    mha = plan_kind(BASE, "mha")
    assert plan.mha_parameters == mha.parameters and mha.mlp_dim is None
    C, L = BASE.embed_dim, BASE.num_layers
    # within the tolerance, or within one hidden unit of the MLP (2C + 1 parameters per layer)
    assert abs(plan.parameters - mha.parameters) <= max(MATCH_TOLERANCE * mha.parameters, L * (2 * C + 1) / 2)
    # the count is the model's own: build it for real
    config = GPTConfig.from_dict({**BASE.to_dict(), "attention": kind, "attention_options": plan.attention_options,
                                  "mlp_dim": plan.mlp_dim})
    assert GPT(config).num_parameters() == plan.parameters


def test_kinds_that_change_the_count_get_another_mlp_width():
    assert plan_kind(BASE, "gqa").mlp_dim > 4 * BASE.embed_dim  # fewer key/value weights: a wider MLP
    assert plan_kind(BASE, "mqa").mlp_dim > plan_kind(BASE, "gqa").mlp_dim
    assert plan_kind(BASE, "dcmha").mlp_dim < 4 * BASE.embed_dim  # its weight generator: a narrower MLP
    assert plan_kind(BASE, "gqa").attention_options == {"num_kv_heads": BASE.num_heads // 2}
    assert plan_kind(BASE, "mha").attention_options == {} and plan_kind(BASE, "overlapping").attention_options == {
        "overlap": 1
    }


def test_costs_come_from_the_layers_cost():
    mha, gqa, mqa = (plan_kind(BASE, k) for k in ("mha", "gqa", "mqa"))
    L, T = BASE.num_layers, BASE.context_length
    attn = GPT(BASE).blocks[0].attn
    assert mha.kv_cache_bytes_per_token == L * attn.cost(1, T, bytes_per_element=4).kv_cache_bytes_per_token  # float32
    assert mha.prefill_flops_per_token == L * attn.cost(T, causal=True).total_flops / T
    assert mha.decode_flops_per_token == L * (attn.cost(1, T).core_flops + attn.cost(1, 1).projection_flops)
    # fewer key/value heads: a smaller cache, fewer FLOPs
    assert mha.kv_cache_bytes_per_token == 2 * gqa.kv_cache_bytes_per_token == 4 * mqa.kv_cache_bytes_per_token
    assert mha.decode_flops_per_token > gqa.decode_flops_per_token > mqa.decode_flops_per_token


def test_parse_kinds_and_its_errors():
    assert parse_kinds(" mha, gqa ,") == ("mha", "gqa")
    with pytest.raises(ValueError, match=r"unknown attention kind 'linear'; known: .*--import MODULE"):
        parse_kinds("mha,linear")
    with pytest.raises(ValueError, match=r"\['mha'\] given more than once"):
        parse_kinds("mha,gqa,mha")
    with pytest.raises(ValueError, match="at least one kind"):
        parse_kinds(" , ")


def test_steps_for_budget():
    # 2 kinds of 0.5 s and 1.5 s per step, 2 seeds: 4 s of steps per step index; 75 % of 60 s -> 11
    assert steps_for_budget(60, [0.5, 1.5], 2) == 11
    with pytest.raises(ValueError, match="fits no training step"):
        steps_for_budget(1, [0.5, 1.5], 2)


def test_planning_draws_no_random_numbers():
    torch.manual_seed(0)
    a = torch.randn(3)
    torch.manual_seed(0)
    plan_kind(BASE, "dcmha")  # models on the meta device: no memory, no random draws
    assert torch.equal(torch.randn(3), a)  # the same draw after the same seed: same operation, same shape
