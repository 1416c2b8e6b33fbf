"""tools.run_with_cache on multihead's own models: every name against an
independent recomputation from the layer's weights, only what was asked
for, and one-line refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from multihead import MultiHeadAttention
from multihead.functional.rope import apply_rope
from multihead.models.bert import BertConfig, BertEncoder
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import ACTIVATION_NAMES, capture, run_with_cache

ALL = tuple(ACTIVATION_NAMES)
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _gpt(**options) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50, context_length=16, embed_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       attention="gqa", **options)  # fmt: skip
    model = GPT(config).eval()
    with torch.no_grad():  # biases that matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _ids(B: int = 2, T: int = 7) -> torch.Tensor:
    return torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(1))


def test_q_k_v_equal_a_recomputation_from_the_layer_weights_with_rope():
    model = _gpt(attention_options={"rope": True})
    ids = _ids()
    out, acts = run_with_cache(model, ids, names=ALL)
    torch.testing.assert_close(out, model(ids))  # the model's output, untouched
    B, T = ids.shape
    x = model.token_embedding(ids) + model.position_embedding(torch.arange(T))  # (B, T, C): layer 0's input
    attn = model.blocks[0].attn
    H, G, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    W, b = attn.qkv_proj.weight, attn.qkv_proj.bias  # rows: [q (H*D) | k (G*D) | v (G*D)]
    y = model.blocks[0].ln_1(x) @ W.T + b  # (B, T, (H + 2G) * D)
    q = y[..., : H * D].reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D)
    k = y[..., H * D : (H + G) * D].reshape(B, T, G, D).transpose(1, 2)  # (B, G, T, D)
    v = y[..., (H + G) * D :].reshape(B, T, G, D).transpose(1, 2)  # (B, G, T, D)
    torch.testing.assert_close(acts["layers.0.resid_pre"], x, **TOL)
    torch.testing.assert_close(acts["layers.0.q"], apply_rope(q, None), **TOL)  # after rope, at 0 .. T-1
    torch.testing.assert_close(acts["layers.0.k"], apply_rope(k, None), **TOL)
    torch.testing.assert_close(acts["layers.0.v"], v, **TOL)
    torch.testing.assert_close(acts["layers.0.q_pre"], q, **TOL)  # before rope
    torch.testing.assert_close(acts["layers.0.k_pre"], k, **TOL)
    assert not torch.allclose(acts["layers.0.q"], q, **TOL)  # rope did turn them
    # q and k give the pattern: causal softmax of q k^T / sqrt(D), key head h // (H // G)
    qr, kr = acts["layers.0.q"], acts["layers.0.k"].repeat_interleave(H // G, dim=1)
    scores = (qr @ kr.transpose(-1, -2)) / D**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(acts["layers.0.pattern"], scores.softmax(-1), **TOL)
    # the last block's output through ln_f and the head gives the logits
    logits = model.lm_head(model.ln_f(acts["layers.1.resid_post"]))
    torch.testing.assert_close(logits, out, **TOL)


def test_z_through_out_proj_is_attn_out_and_the_block_adds_up():
    model = _gpt()
    _, acts = run_with_cache(model, _ids(), names=ALL)
    for i, block in enumerate(model.blocks):
        z = acts[f"layers.{i}.z"]  # (B, H, T, Dv)
        B, H, T, Dv = z.shape
        W = block.attn.out_proj.weight  # (C, H * Dv)
        per_head = torch.stack([z[:, h] @ W[:, h * Dv : (h + 1) * Dv].T for h in range(H)])  # (H, B, T, C)
        torch.testing.assert_close(per_head.sum(0) + block.attn.out_proj.bias, acts[f"layers.{i}.attn_out"], **TOL)
        # z is the pattern times the values (key/value head h // (H // G))
        v = acts[f"layers.{i}.v"].repeat_interleave(H // acts[f"layers.{i}.v"].shape[1], dim=1)
        torch.testing.assert_close(acts[f"layers.{i}.pattern"] @ v, z, **TOL)
        mid = acts[f"layers.{i}.resid_pre"] + acts[f"layers.{i}.attn_out"]
        torch.testing.assert_close(mid + block.mlp(block.ln_2(mid)), acts[f"layers.{i}.resid_post"], **TOL)


def test_z_is_what_out_proj_reads_inside_mask_heads():
    from multihead.tools import mask_heads

    model = _gpt()
    with mask_heads(model, {1: [2]}):
        _, acts = run_with_cache(model, _ids(), names=["z", "attn_out", "pattern"], layers=[1])
    z = acts["layers.1.z"]  # (B, H, T, Dv)
    assert z[:, 2].abs().max() == 0 and z[:, 1].abs().max() > 0  # the masked head's output, as out_proj sees it
    assert acts["layers.1.pattern"][:, 2].abs().max() > 0  # its weights are still there
    attn = model.blocks[1].attn
    merged = z.transpose(1, 2).reshape(z.shape[0], z.shape[2], -1)  # (B, H, T, Dv) -> (B, T, H*Dv)
    torch.testing.assert_close(attn.out_proj(merged), acts["layers.1.attn_out"], **TOL)


def test_pattern_equals_capture_weights_for_the_heads_asked():
    model = _gpt()
    ids = _ids()
    with capture(model) as record:
        model(ids)
    _, acts = run_with_cache(model, ids, names=["pattern", "q", "k", "v", "z"], heads=[1, 3], layers=[1])
    torch.testing.assert_close(acts["layers.1.pattern"].float(), record.layers[1].weights[:, [1, 3]], **TOL)
    _, whole = run_with_cache(model, ids, names=["q", "k", "v", "z"], layers=[1])
    assert acts.kv_heads == {1: (0, 1)}  # heads 1 and 3 read key/value heads 0 and 1 (H // G = 2)
    for name, index in (("q", [1, 3]), ("z", [1, 3]), ("k", [0, 1]), ("v", [0, 1])):
        torch.testing.assert_close(acts[f"layers.1.{name}"], whole[f"layers.1.{name}"][:, index])
    _, one = run_with_cache(model, ids, names=["k"], heads=[2])
    assert one.kv_heads == {0: (1,), 1: (1,)} and one["layers.0.k"].shape[1] == 1


def test_only_what_was_asked_is_stored_and_every_hook_is_removed():
    model = _gpt()
    ids = _ids()
    _, acts = run_with_cache(model, ids, names=["z"], layers=[1], heads=[2])
    assert acts.keys() == ["layers.1.z"] and acts.names == ("z",) and acts.layers == (1,)
    z = acts["layers.1.z"]
    assert z.shape == (2, 1, 7, 8) and not z.requires_grad
    assert z.untyped_storage().nbytes() == z.numel() * z.element_size()  # a copy, not a view of every head
    _, acts = run_with_cache(model, ids, names="q")
    assert acts.keys() == ["layers.0.q", "layers.1.q"]
    for block in model.blocks:
        attn = block.attn
        assert not attn.observed and not attn._head_hooks and not attn._forward_hooks
        assert not block._forward_hooks and not block._forward_pre_hooks
    _, acts = run_with_cache(model, ids, names=["k_pre", "q"], heads=[3])
    assert acts.keys() == ["layers.0.k_pre", "layers.0.q", "layers.1.k_pre", "layers.1.q"]
    _, k = run_with_cache(model, ids, names=["k"], heads=[3])
    torch.testing.assert_close(acts["layers.1.k_pre"], k["layers.1.k"])  # no rope: the same keys
    assert all("to_heads" not in vars(block.attn) for block in model.blocks)  # the method is back


def test_encoder_layers_and_a_bare_layer():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=24, num_layers=3, num_heads=4, intermediate_size=32,
                        max_position_embeddings=16)  # fmt: skip
    encoder = BertEncoder(config).eval()
    ids = torch.randint(0, 40, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    _, acts = run_with_cache(encoder, ids, attention_mask=mask, names=["resid_pre", "resid_post", "pattern"])
    for i in range(2):
        torch.testing.assert_close(acts[f"layers.{i}.resid_post"], acts[f"layers.{i + 1}.resid_pre"], rtol=0, atol=0)
    assert acts["layers.0.pattern"][1, :, :, 3:].abs().max() == 0  # padding is never read
    layer = MultiHeadAttention(16, 4)
    x = torch.randn(1, 3, 16)
    out, acts = run_with_cache(layer, x, names=["attn_out", "z"])
    torch.testing.assert_close(acts.layer(0).attn_out, out.detach(), rtol=0, atol=0)


def test_a_sentence_encoder_last_block_output_is_its_last_hidden_state():
    from support.encoders import tiny_encoder

    model = tiny_encoder()
    ids = torch.randint(5, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    emb, acts = run_with_cache(model, ids, mask, names=["resid_post"], layers=[1])
    assert acts.keys() == ["layers.1.resid_post"]
    torch.testing.assert_close(emb, model(ids, mask))
    torch.testing.assert_close(acts["layers.1.resid_post"], model.encoder(ids, attention_mask=mask))


def test_differential_q_keeps_its_sub_heads_and_refuses_a_head_cut():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, context_length=16, embed_dim=32, num_layers=1, num_heads=2,
                          attention="diff")).eval()  # fmt: skip
    _, acts = run_with_cache(model, _ids(), names=["q", "pattern"])
    assert acts["layers.0.q"].shape[1] == 4 and acts["layers.0.pattern"].shape[1] == 2
    with pytest.raises(ValueError, match=r"has 4 q heads, 4 k heads, 2 v heads for its 2 query heads") as err:
        run_with_cache(model, _ids(), names=["q"], heads=[1])
    assert "\n" not in str(err.value)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, context_length=16, embed_dim=32, num_layers=1, num_heads=4,
                          attention="collaborative")).eval()  # fmt: skip
    with pytest.raises(ValueError, match=r"has 4 q heads, 1 k heads, 4 v heads for its 4 query heads"):
        run_with_cache(model, _ids(), names=["v"], heads=[1])  # one shared key head, a value head per head
    _, acts = run_with_cache(model, _ids(), names=["pattern", "z"], heads=[1])  # these cut by query head
    assert acts["layers.0.pattern"].shape[1] == acts["layers.0.z"].shape[1] == 1


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = MultiHeadAttention(8, 2)

    def forward(self, x):
        return self.attn(self.attn(x))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"names": ["q", "hook_q"]}, r"unknown name\(s\) \['hook_q'\]; valid names: \['q', 'k', 'q_pre', 'k_pre', 'v', 'pattern'"),
        ({"names": []}, "no name; valid names"),
        ({"names": ["q", "q"]}, "a name given twice"),
        ({"names": [3]}, "names must be a list of str"),
        ({"layers": [2]}, r"asks for layer 2, but the model has 2 attention modules"),
        ({"layers": [1, 0]}, "ascending"),
        ({"heads": [4]}, r"heads=\[4\] asks for head 4, but layer 0 \(blocks.0.attn\) has 4 heads"),
        ({"heads": [2, 1]}, "ascending"),
    ],
)
def test_bad_names_layers_and_heads_are_one_line_errors_before_the_run(kwargs, message):
    model = _gpt()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises((ValueError, TypeError), match=message) as err:
        run_with_cache(model, _ids(), **kwargs)
    assert "\n" not in str(err.value) and not calls  # refused before the model ran


def test_refusals_of_the_model():
    with pytest.raises(ValueError, match="no nn.ModuleList of 1 blocks"):
        run_with_cache(MultiHeadAttention(8, 2), torch.randn(1, 3, 8), names=["resid_pre"])
    with pytest.raises(ValueError, match="contains no multihead attention module"):
        run_with_cache(nn.Linear(3, 3), torch.randn(1, 3))
    with pytest.raises(ValueError, match=r"layer 0 \(attn\) ran twice in one forward"):
        run_with_cache(Twice(), torch.randn(1, 3, 8), names=["q"])
    assert not Twice().attn.observed
