"""``tools.head_effects``: each map equals a hand computation that edits the out_proj input by hand.

The reference below never uses head hooks: a forward pre-hook on the
layer's ``out_proj`` overwrites head h's columns h*Dv .. (h+1)*Dv of its
input [B, T, H*Dv] (zeros, the clean mean of those columns, or the columns
recorded from the other run), one forward per head, and the metric is
read off by hand. "zero" is also checked against removing the head with
``prune_heads``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.kinds import F64, C, build

from multihead import list_attention_kinds
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import HeadEffects, head_effects, logit_difference
from multihead.tools.heads import attention_layers
from multihead.tools.prune import prune_heads

V, T = 40, 7
TOL = dict(rtol=1e-7, atol=1e-10)  # float64 models: batched and unbatched forwards round alike to ~1e-15


def gpt(attention="mha", seed=0, **options) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=V, context_length=16, embed_dim=24, num_layers=2, num_heads=4, attention=attention,
                       **options)  # fmt: skip
    model = GPT(config).double().eval()
    with torch.no_grad():  # larger contexts and out_proj biases well away from zero (the bias stays when a head goes)
        for layer in attention_layers(model):
            layer.out_proj.weight.mul_(8.0)
            layer.out_proj.bias.uniform_(-1.0, 1.0)
    return model


def prompts(seed=1, B=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(V, (B, T), generator=g), torch.randint(V, (B, T), generator=g)


def hand_logit_difference(logits, answer, wrong):  # written out: no shared code with logit_difference
    return sum(float(logits[b, -1, answer]) - float(logits[b, -1, wrong]) for b in range(logits.shape[0])) / logits.shape[0]


def out_proj_inputs(model, x):
    """Each layer's out_proj input [B, T, H*Dv] on x."""
    seen = []
    handles = [layer.out_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].clone()))
               for layer in attention_layers(model)]  # fmt: skip
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


def hand_map(model, method, clean, corrupted, metric):
    layers = attention_layers(model)
    clean_in, corrupted_in = out_proj_inputs(model, clean), out_proj_inputs(model, corrupted)
    base = corrupted if method == "restore" else clean
    with torch.no_grad():
        baseline = metric(model(base))
    table = torch.full((len(layers), layers[0].num_heads), float("nan"), dtype=torch.float64)
    for i, layer in enumerate(layers):
        H = layer.num_heads
        Dv = layer.out_proj.in_features // H
        for h in range(H):
            cols = slice(h * Dv, (h + 1) * Dv)

            def edit(module, args, i=i, cols=cols):
                x = args[0].clone()
                if method == "zero":
                    x[..., cols] = 0.0
                elif method == "mean":
                    x[..., cols] = clean_in[i][..., cols].mean(dim=(0, 1))
                elif method == "patch":
                    x[..., cols] = corrupted_in[i][..., cols]
                else:
                    x[..., cols] = clean_in[i][..., cols]
                return (x,)

            handle = layer.out_proj.register_forward_pre_hook(edit)
            with torch.no_grad():
                table[i, h] = metric(model(base)) - baseline
            handle.remove()
    return table


@pytest.mark.parametrize("method", ["zero", "mean", "patch", "restore"])
@pytest.mark.parametrize("attention, options", [("mha", {}), ("gqa", {"num_kv_heads": 2})])
def test_each_method_equals_editing_the_out_proj_input_by_hand(method, attention, options):
    model = gpt(attention, **options)
    clean, corrupted = prompts()
    metric = logit_difference(3, 5)
    want = hand_map(model, method, clean, corrupted, lambda logits: hand_logit_difference(logits, 3, 5))
    for batch_size in (1, 3):  # one intervention per forward, and three copies per forward
        got = head_effects(model, clean, corrupted, metric=metric, method=method, batch_size=batch_size)
        torch.testing.assert_close(got.effects, want, **TOL)
    assert got.method == method and got.num_heads == [4, 4] and got.effects.abs().max() > 1e-5
    with torch.no_grad():
        assert got.clean == pytest.approx(hand_logit_difference(model(clean), 3, 5), rel=1e-9)
        assert got.corrupted == pytest.approx(hand_logit_difference(model(corrupted), 3, 5), rel=1e-9)
    assert got.baseline == (got.corrupted if method == "restore" else got.clean)


def test_zero_equals_the_metric_change_of_removing_the_head_with_prune_heads():
    model = gpt()
    clean, _ = prompts()
    metric = logit_difference([3, 4], [5, 6])  # one answer per batch item
    got = head_effects(model, clean, metric=metric, method="zero")
    with torch.no_grad():
        whole = metric(model(clean))
        for i in range(2):
            for h in range(4):
                pruned = prune_heads(copy.deepcopy(model), {i: [h]}).eval()
                assert got.effects[i, h].item() == pytest.approx(metric(pruned(clean)) - whole, rel=1e-7, abs=1e-10)


def test_replacing_after_out_proj_is_a_different_and_wrong_map():
    """Zeroing head h's slice of the layer's output (after out_proj) is not removing the head: the map differs."""
    model = gpt()
    clean, _ = prompts()
    metric = logit_difference(3, 5)
    got = head_effects(model, clean, metric=metric, method="zero").effects
    layers = attention_layers(model)
    with torch.no_grad():
        whole = metric(model(clean))
        wrong = torch.zeros(2, 4, dtype=torch.float64)
        for i, layer in enumerate(layers):
            for h in range(4):
                cut = slice(h * 6, (h + 1) * 6)
                handle = layer.register_forward_hook(lambda m, a, out, cut=cut: out.index_fill(-1, torch.arange(24)[cut], 0.0))
                wrong[i, h] = metric(model(clean)) - whole
                handle.remove()
    assert (got - wrong).abs().max() > 1e-5


def test_patching_with_the_clean_input_itself_gives_an_all_zero_map():
    model = gpt()
    clean, _ = prompts()
    for method in ("patch", "restore"):
        got = head_effects(model, clean, clean.clone(), metric=logit_difference(3, 5), method=method)
        torch.testing.assert_close(got.effects, torch.zeros(2, 4, dtype=torch.float64), rtol=0, atol=1e-12)


def test_heads_picks_entries_and_top_ranks_by_size():
    model = gpt()
    clean, corrupted = prompts()
    full = head_effects(model, clean, corrupted, metric=logit_difference(3, 5))
    part = head_effects(model, clean, corrupted, metric=logit_difference(3, 5), heads={1: [2, 0]})
    measured = ~part.effects.isnan()
    assert measured.nonzero().tolist() == [[1, 0], [1, 2]]
    torch.testing.assert_close(part.effects[measured], full.effects[measured], **TOL)
    top = full.top(3)
    assert [abs(v) for _, _, v in top] == sorted((abs(v) for v in full.effects.flatten().tolist()), reverse=True)[:3]
    data = part.to_dict()
    assert data["effects"][0] == [None] * 4 and data["method"] == "patch" and data["layers"] == part.layer_names


def test_a_coupled_kind_is_refused_with_its_reason_and_measured_as_output_slots_when_asked():
    clean, corrupted = prompts()
    dcmha = gpt("dcmha")
    with pytest.raises(ValueError, match="'dcmha' attention, whose heads are not independent: the composition mixes"):
        head_effects(dcmha, clean, corrupted, metric=logit_difference(3, 5))
    moh = gpt("moh", attention_options={"shared_heads": 1, "routed_heads": 2})
    metric = logit_difference(3, 5)
    got = head_effects(moh, clean, corrupted, metric=metric, method="patch", coupled_heads=True)
    want = hand_map(moh, "patch", clean, corrupted, lambda logits: hand_logit_difference(logits, 3, 5))
    torch.testing.assert_close(got.effects, want, **TOL)  # slot h = head h's router-gated output
    slots = head_effects(dcmha, clean, corrupted, metric=metric, method="zero", coupled_heads=True)
    torch.testing.assert_close(slots.effects, hand_map(dcmha, "zero", clean, corrupted,
                                                       lambda logits: hand_logit_difference(logits, 3, 5)), **TOL)  # fmt: skip


def test_mistakes_are_one_line_errors():
    model = gpt()
    clean, corrupted = prompts()
    metric = logit_difference(3, 5)
    cases = [
        (dict(method="ablate"), ValueError, "method='ablate': unknown; valid: zero, mean, patch, restore"),
        (dict(method="patch", corrupted=None), ValueError, "method='patch' needs a corrupted input"),
        (dict(corrupted=corrupted[:, :5]), ValueError, r"same shapes, got \[\(2, 7\)\] and \[\(2, 5\)\]"),
        (dict(heads={2: [0]}), ValueError, r"layer index=2 out of range \[0, 2\)"),
        (dict(heads={0: [4]}), ValueError, r"head=4 out of range \[0, 4\) in layer 0 with 4 heads"),
        (dict(batch_size=0), ValueError, "batch_size"),
        (dict(metric=lambda out: out[:, -1, 0]), ValueError, r"metric must return a scalar, got a tensor of shape \(2,\)"),
        (dict(metric="logits"), TypeError, "metric must be callable"),
        (dict(metric=logit_difference(3, V)), ValueError, f"wrong_id {V} is not below the vocabulary size {V}"),
        (dict(metric=logit_difference([3], 5)), ValueError, "answer_id lists 1 ids for a batch of 2"),
        (dict(clean="ids"), TypeError, "clean must be a tensor or a tuple of tensors"),
    ]
    for options, error, message in cases:
        kwargs = {"clean": clean, "corrupted": corrupted, "metric": metric, **options}
        with pytest.raises(error, match=message) as info:
            head_effects(model, **kwargs)
        assert "\n" not in str(info.value)
    with pytest.raises(TypeError, match="answer_id must be a token id"):
        logit_difference(-1, 5)


def test_the_result_is_a_head_effects_and_the_model_keeps_its_mode_and_hooks():
    model = gpt().train()
    clean, corrupted = prompts()
    got = head_effects(model, clean, corrupted, metric=logit_difference(3, 5), method="mean")
    assert isinstance(got, HeadEffects) and model.training
    assert all(not layer._head_hooks for layer in attention_layers(model))


class Causal(torch.nn.Module):
    """One attention layer of a kind as a model: causal self-attention over x [B, T, C]."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x, is_causal=True)


@pytest.mark.parametrize("kind", list_attention_kinds())
def test_every_kind_replaces_exactly_its_out_proj_columns(kind):
    """For every registered kind, head h's context in the head hooks is head h's slice of the out_proj input."""
    model = Causal(build(kind))
    g = torch.Generator().manual_seed(3)
    clean, corrupted = torch.randn(2, 5, C, dtype=F64, generator=g), torch.randn(2, 5, C, dtype=F64, generator=g)
    probe = torch.randn(2, 5, model.layer.out_proj.out_features, dtype=F64, generator=g)

    def metric(out):
        return float((out * probe).sum())

    coupled = not model.layer.independent_heads
    for method in ("mean", "patch"):
        got = head_effects(model, clean, corrupted, metric=metric, method=method, coupled_heads=coupled)
        want = hand_map(model, method, clean, corrupted, metric)
        torch.testing.assert_close(got.effects, want, **TOL)
        assert got.effects.abs().min() > 1e-6, kind


class Pair(torch.nn.Module):
    """A GPT whose output is a tuple holding a dict: batched interventions split every tensor in it."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        logits = self.model(ids)
        return logits, {"last": logits[:, -1], "note": "kept"}


def test_tuple_and_dict_outputs_split_per_intervention_and_progress_is_shown(capsys):
    model = Pair(gpt())
    clean, corrupted = prompts()
    seen = []

    def metric(output):
        logits, extra = output
        seen.append((logits.shape[0], extra["last"].shape[0], extra["note"]))
        return float(extra["last"][:, 3].mean() - extra["last"][:, 5].mean())

    one = head_effects(model, clean, corrupted, metric=metric, batch_size=1)
    three = head_effects(model, clean, corrupted, metric=metric, batch_size=3, progress=True)
    torch.testing.assert_close(three.effects, one.effects, **TOL)
    assert set(seen) == {(2, 2, "kept")}
    err = capsys.readouterr().err
    assert "head effects (patch)" in err and "3/3" in err  # 8 heads in forwards of 3, 3, 2


def test_an_output_without_a_batch_to_split_asks_for_batch_size_one():
    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = gpt()

        def forward(self, ids):
            return float(self.model(ids)[:, -1, 3].mean())  # one number for the whole batch

    clean, corrupted = prompts()
    with pytest.raises(TypeError, match="holds a float, which cannot be split per intervention; pass batch_size=1"):
        head_effects(Loss(), clean, corrupted, metric=lambda x: x)
    head_effects(Loss(), clean, corrupted, metric=lambda x: x, batch_size=1)
