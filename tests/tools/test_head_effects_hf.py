"""``tools.head_effects`` on transformers models running ``attn_implementation="multihead"``.

The reference never goes through the bridge: a copy of the model on
transformers' own SDPA attention (float64 throughout; eager's softmax runs
in float32) gets a plain forward pre-hook on each
layer's output projection (``o_proj``, GPT-2's ``c_proj``) that overwrites
head h's columns h*Dv .. (h+1)*Dv of its input [B, T, H*Dv] (zeros, the
clean mean of those columns, or the columns recorded from the other run),
one forward per head, the metric written out by hand. Models are tiny,
random and float64 (a GQA Llama: 6 query heads, 2 key/value heads), built
from configs, so SDPA and multihead agree to ~1e-12. A GPT-2's map is
also compared with the same weights in multihead's own GPT.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from support.hf_gpt2 import hf_model, ours_from  # noqa: E402

import multihead.hf  # noqa: E402
from multihead.tools import head_effects, logit_difference  # noqa: E402

V, T = 61, 6
METHODS = ("zero", "mean", "patch", "restore")
TOL = dict(rtol=1e-7, atol=1e-9)


def llama():
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").double().eval()
    with torch.no_grad():  # larger head outputs, so each head's effect stands out of rounding
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(8.0)
            layer.self_attn.v_proj.weight.mul_(4.0)
    return model


def gpt2():
    model = hf_model(vocab_size=V).double()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_proj.weight.mul_(8.0)
    return model


def on_multihead(reference):
    model = copy.deepcopy(reference)
    model.set_attn_implementation(multihead.hf.NAME)
    return model


def projections(model) -> list[torch.nn.Module]:
    if hasattr(model, "transformer"):
        return [block.attn.c_proj for block in model.transformer.h]
    return [layer.self_attn.o_proj for layer in model.model.layers]


def prompts(seed=1, B=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)


def hand_metric(model, x, answer=3, wrong=7) -> float:
    with torch.no_grad():
        logits = model(x, use_cache=False).logits
    return sum(float(logits[b, -1, answer]) - float(logits[b, -1, wrong]) for b in range(x.shape[0])) / x.shape[0]


def projection_inputs(model, x) -> list[torch.Tensor]:
    seen = []
    handles = [p.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone())) for p in projections(model)]
    hand_metric(model, x)
    for h in handles:
        h.remove()
    return seen


def hand_map(reference, method, clean, corrupted) -> torch.Tensor:
    H = reference.config.num_attention_heads
    Dv = reference.config.hidden_size // H
    clean_in, corrupted_in = projection_inputs(reference, clean), projection_inputs(reference, corrupted)
    base = corrupted if method == "restore" else clean
    baseline = hand_metric(reference, base)
    table = torch.zeros(len(clean_in), H, dtype=torch.float64)
    for i, projection in enumerate(projections(reference)):
        for h in range(H):
            cols = slice(h * Dv, (h + 1) * Dv)

            def edit(module, args, i=i, cols=cols):
                x = args[0].clone()  # (B, T, H*Dv)
                if method == "zero":
                    x[..., cols] = 0.0
                elif method == "mean":
                    x[..., cols] = clean_in[i][..., cols].mean(dim=(0, 1))
                elif method == "patch":
                    x[..., cols] = corrupted_in[i][..., cols]
                else:
                    x[..., cols] = clean_in[i][..., cols]
                return (x,)

            handle = projection.register_forward_pre_hook(edit)
            table[i, h] = hand_metric(reference, base) - baseline
            handle.remove()
    return table


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request):
    reference = gpt2() if request.param == "gpt2" else llama()
    return request.param, reference, on_multihead(reference)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_equals_editing_the_output_projection_input_by_hand(pair, method):
    _, reference, model = pair
    clean, corrupted = prompts()
    found = head_effects(model, clean, corrupted, metric=logit_difference(3, 7), method=method, batch_size=4)
    want = hand_map(reference, method, clean, corrupted)
    assert found.effects.abs().max() > 1e-2  # the heads matter: the comparison is not of zeros
    torch.testing.assert_close(found.effects, want, **TOL)
    assert found.clean == pytest.approx(hand_metric(reference, clean), rel=1e-9)
    assert found.corrupted == pytest.approx(hand_metric(reference, corrupted), rel=1e-9)
    H = reference.config.num_attention_heads
    assert found.num_heads == [H, H] and len(found.layer_names) == 2
    assert found.layer_names[1] in dict(model.named_modules()) and found.layer_names[1].endswith("1.self_attn" if
                                                                                                   pair[0] == "llama" else "h.1.attn")  # fmt: skip


def test_batched_and_one_at_a_time_agree_and_heads_pick_entries(pair):
    _, _, model = pair
    clean, corrupted = prompts(seed=2, B=1)
    metric = logit_difference(3, 7)
    whole = head_effects(model, clean, corrupted, metric=metric, method="patch", batch_size=5)
    single = head_effects(model, clean, corrupted, metric=metric, method="patch", batch_size=1)
    torch.testing.assert_close(whole.effects, single.effects, **TOL)
    H = model.config.num_attention_heads
    part = head_effects(model, clean, corrupted, metric=metric, method="patch", heads={1: [0, H - 1]})
    assert torch.isnan(part.effects[0]).all() and torch.isnan(part.effects[1, 1 : H - 1]).all()
    torch.testing.assert_close(part.effects[1, [0, H - 1]], whole.effects[1, [0, H - 1]], **TOL)


@pytest.mark.parametrize("method", METHODS)
def test_a_gpt2_map_equals_the_same_weights_in_multihead_gpt(method):
    reference = gpt2()
    model, ours = on_multihead(reference), ours_from(reference).double()
    clean, corrupted = prompts(seed=3)
    metric = logit_difference(3, 7)
    through_bridge = head_effects(model, clean, corrupted, metric=metric, method=method)
    own = head_effects(ours, clean, corrupted, metric=metric, method=method)
    torch.testing.assert_close(through_bridge.effects, own.effects, **TOL)
    assert through_bridge.clean == pytest.approx(own.clean, rel=1e-9)


def test_refusals_name_the_values():
    reference = llama()
    clean, _ = prompts()
    with pytest.raises(ValueError, match="runs attn_implementation='sdpa', not 'multihead'"):
        head_effects(reference, clean, metric=logit_difference(3, 7), method="zero")
    model = on_multihead(reference)
    with pytest.raises(ValueError, match="head=6 out of range \\[0, 6\\) in layer 1 with 6 heads"):
        head_effects(model, clean, metric=logit_difference(3, 7), method="zero", heads={1: [6]})
    with pytest.raises(ValueError, match="layer index=2 out of range"):
        head_effects(model, clean, metric=logit_difference(3, 7), method="zero", heads={2: [0]})
    with pytest.raises(ValueError, match="contains no multihead attention layer \\(nor is it a transformers model"):
        head_effects(torch.nn.Linear(2, 2), clean, metric=logit_difference(3, 7), method="zero")
