"""``multihead.hf.head_hook``: see and replace each head's output before the output projection.

The reference is the same weights on transformers' SDPA attention (float64)
with a plain forward pre-hook on ``o_proj`` that reads or overwrites its
input [B, T, H*Dv]: head h is columns h*Dv .. (h+1)*Dv.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import multihead.hf as mhf  # noqa: E402

V = 61


def models():
    """(sdpa reference, the same weights on multihead): a tiny GQA Llama, float64."""
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa").double().eval()
    model = copy.deepcopy(reference)
    model.set_attn_implementation(mhf.NAME)
    return reference, model


def ids(B=2, T=5):
    return torch.randint(V, (B, T), generator=torch.Generator().manual_seed(1))


def o_proj_inputs(model, x) -> list[torch.Tensor]:
    seen = []
    handles = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].clone()))
               for layer in model.model.layers]  # fmt: skip
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    return seen


def test_the_hook_sees_each_layers_heads_and_its_replacement_reaches_o_proj():
    reference, model = models()
    x = ids()
    B, T, H, Dv = 2, 5, 6, 4
    seen = []

    def keep(module, layer, out):
        seen.append((module, layer, out.clone()))

    with torch.no_grad(), mhf.head_hook(model, keep):
        model(x)
    assert [(m, i) for m, i, _ in seen] == [(layer.self_attn, i) for i, layer in enumerate(model.model.layers)]
    for (_, _, out), merged in zip(seen, o_proj_inputs(reference, x)):
        assert out.shape == (B, H, T, Dv)
        torch.testing.assert_close(out.transpose(1, 2).reshape(B, T, H * Dv), merged, rtol=1e-10, atol=1e-12)

    new = torch.randn(B, T, Dv, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def swap(module, layer, out):
        if layer == 1:
            out = out.clone()
            out[:, 4] = new
            return out
        return None

    def write(module, args):
        x = args[0].clone()
        x[..., 4 * Dv : 5 * Dv] = new  # (B, T, H*Dv): head 4's columns
        return (x,)

    with torch.no_grad(), mhf.head_hook(model, swap):
        got = model(x).logits
    handle = reference.model.layers[1].self_attn.o_proj.register_forward_pre_hook(write)
    with torch.no_grad():
        want = reference(x).logits
    handle.remove()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    with torch.no_grad():  # outside the block nothing is replaced
        torch.testing.assert_close(model(x).logits, reference(x).logits, rtol=1e-10, atol=1e-12)


def test_gates_entered_before_are_seen_and_other_models_are_untouched():
    reference, model = models()
    other = copy.deepcopy(model)
    x = ids()
    gates = torch.ones(2, 6, dtype=torch.float64)
    gates[0, 2] = 0.0
    seen = {}
    with torch.no_grad(), mhf.head_gates(model, gates), mhf.head_hook(model, lambda m, i, out: seen.setdefault(i, out.clone())):
        model(x)
        torch.testing.assert_close(other(x).logits, reference(x).logits, rtol=1e-10, atol=1e-12)
    assert seen[0][:, 2].abs().max() == 0 and seen[0][:, 1].abs().max() > 0 and seen[1][:, 2].abs().max() > 0


def test_mistakes_name_the_values():
    reference, model = models()
    x = ids()
    with pytest.raises(ValueError, match="runs attn_implementation='sdpa', not 'multihead'"):
        with mhf.head_hook(reference, lambda m, i, out: None):
            pass
    with pytest.raises(TypeError, match="head hook must be callable, got int"):
        with mhf.head_hook(model, 3):
            pass
    with pytest.raises(ValueError, match=r"returned shape \(2, 6, 5\) for model.layers.0.self_attn, whose head outputs "
                                         r"are \(2, 6, 5, 4\)"):  # fmt: skip
        with torch.no_grad(), mhf.head_hook(model, lambda m, i, out: out[..., 0]):
            model(x)
    with pytest.raises(TypeError, match="returned a float for model.layers.0.self_attn"):
        with torch.no_grad(), mhf.head_hook(model, lambda m, i, out: 0.0):
            model(x)
