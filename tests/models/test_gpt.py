"""GPT: config and presets, forward, and parity with Hugging Face GPT-2.

Tolerances (docs policy): float32 logits use torch.testing defaults
(rtol 1.3e-6, atol 1e-5); float64 logits match to 1e-10. Nothing is
downloaded: the Hugging Face model is randomly initialised from a small
GPT2Config and copied into ours with ``convert.hf_gpt2`` (whose own tests
are in tests/convert/test_hf_gpt2.py).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from support.hf_gpt2 import SMALL_HF, hf_model, ours_from  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from multihead.models.gpt import GPT, GPT_PRESETS, GPTConfig, positions_from_mask  # noqa: E402


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig.from_preset("tiny", **{"context_length": 32, "vocab_size": 61, **overrides})


@pytest.fixture(scope="module")
def pair():
    hf = hf_model()
    return hf, ours_from(hf)


# ------------------------------------------------------------------ parity
def test_logits_match_hf_float32(pair):
    hf, ours = pair
    idx = torch.randint(0, 97, (3, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits)


def test_logits_match_hf_float64():
    hf = hf_model(seed=3).double()
    ours = ours_from(hf)
    assert ours.token_embedding.weight.dtype == torch.float64
    idx = torch.randint(0, 97, (2, 31), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        err = (ours(idx) - hf(idx).logits).abs().max().item()
    assert err < 1e-10, err


def test_left_padded_logits_match_hf_and_unpadded(pair):
    hf, ours = pair
    g = torch.Generator().manual_seed(4)
    full, short = torch.randint(1, 97, (1, 9), generator=g), torch.randint(1, 97, (1, 5), generator=g)
    idx = torch.cat([full, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1)])  # (2, 9)
    mask = torch.tensor([[1] * 9, [0] * 4 + [1] * 5])
    positions = positions_from_mask(mask)
    with torch.no_grad():
        got = ours(idx, attention_mask=mask)
        want = hf(idx, attention_mask=mask, position_ids=positions).logits
        alone = ours(short)
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()])
    torch.testing.assert_close(got[1, 4:], alone[0])
    torch.testing.assert_close(got[0], ours(full)[0].detach())


def test_hf_config_translation():
    cfg = GPTConfig.from_hf_config(GPT2Config(**SMALL_HF))
    assert cfg == GPTConfig(vocab_size=97, context_length=64, embed_dim=64, num_layers=2, num_heads=4)
    assert GPTConfig.from_hf_config(GPT2Config(**cfg.to_hf_config())) == cfg
    assert isinstance(GPT.from_hf_config(SMALL_HF), GPT)
    with pytest.raises(ValueError, match="activation_function='relu'"):
        GPTConfig.from_hf_config({**SMALL_HF, "activation_function": "relu"})
    with pytest.raises(ValueError, match="one dropout rate"):
        GPTConfig.from_hf_config({**SMALL_HF, "attn_pdrop": 0.2})
    inner = GPTConfig.from_hf_config({**SMALL_HF, "n_inner": 100})  # a hidden MLP width other than 4C
    assert inner.mlp_dim == 100 and GPTConfig.from_hf_config(GPT2Config(**inner.to_hf_config())) == inner


def test_mlp_width_other_than_4c_matches_hugging_face():
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**{**SMALL_HF, "n_inner": 100})).eval()
    ours = ours_from(hf)
    assert ours.blocks[0].mlp.fc.weight.shape == (100, 64)
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits)


# ------------------------------------------------------------------ presets
def test_preset_sizes():
    assert set(GPT_PRESETS) == {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny", "mini", "shakespeare-cpu"}
    sizes = {n: (c.embed_dim, c.num_layers, c.num_heads) for n in GPT_PRESETS for c in [GPTConfig.from_preset(n)]}
    assert sizes == {
        "gpt2-small": (768, 12, 12),
        "gpt2-medium": (1024, 24, 16),
        "gpt2-large": (1280, 36, 20),
        "gpt2-xl": (1600, 48, 25),
        "tiny": (64, 2, 4),
        "mini": (128, 4, 4),
        "shakespeare-cpu": (256, 6, 4),
    }
    assert GPTConfig.from_preset("tiny").vocab_size == 256 and GPTConfig.from_preset("mini").context_length == 256
    assert GPTConfig.from_preset("gpt2-small").vocab_size == 50257
    assert GPTConfig.from_preset("tiny", num_layers=3).num_layers == 3


@pytest.mark.parametrize("name", ["GPT2-small", "gpt2", "tiny ", "small"])
def test_unknown_preset_lists_valid_names(name):
    with pytest.raises(ValueError, match=r"unknown GPT preset .*valid presets: \[.*'gpt2-small'.*'tiny'\]"):
        GPTConfig.from_preset(name)


def test_unknown_override_is_an_error():
    with pytest.raises(ValueError, match=r"unknown GPTConfig field\(s\) \['n_layer'\]"):
        GPTConfig.from_preset("tiny", n_layer=3)


@pytest.mark.parametrize(
    "name,hf_kwargs",
    [
        ("gpt2-small", {}),
        ("gpt2-medium", dict(n_embd=1024, n_layer=24, n_head=16)),
        ("gpt2-xl", dict(n_embd=1600, n_layer=48, n_head=25)),
    ],
)
def test_preset_parameter_count_equals_hf(name, hf_kwargs):
    with torch.device("meta"):  # shapes only, no memory
        hf = GPT2LMHeadModel(GPT2Config(**hf_kwargs))
        ours = GPT(GPTConfig.from_preset(name))
    want = sum(p.numel() for p in hf.parameters())
    assert ours.num_parameters() == sum(p.numel() for p in ours.parameters()) == want
    if name == "gpt2-small":
        assert want == 124_439_808


# ------------------------------------------------------------------ config validation
@pytest.mark.parametrize(
    "overrides,exc,match",
    [
        ({"vocab_size": 0}, ValueError, "vocab_size=0"),
        ({"context_length": -3}, ValueError, "context_length=-3"),
        ({"num_layers": 2.0}, TypeError, "num_layers=2.0"),
        ({"embed_dim": 66}, ValueError, "embed_dim=66 is not divisible by num_heads=4"),
        ({"num_kv_heads": 3}, ValueError, "num_kv_heads=3 must divide num_heads=4"),
        ({"num_kv_heads": 0}, ValueError, "num_kv_heads=0"),
        ({"attention": "flash"}, ValueError, r"unknown attention kind 'flash'; known: \[.*'mha'"),
        ({"dropout": 1.0}, ValueError, "dropout=1.0"),
        ({"layer_norm_eps": 0.0}, ValueError, "layer_norm_eps=0.0"),
        ({"qkv_bias": 1}, TypeError, "qkv_bias=1"),
        ({"tie_embeddings": "yes"}, TypeError, "tie_embeddings='yes'"),
    ],
)
def test_config_validation_names_the_values(overrides, exc, match):
    with pytest.raises(exc, match=match):
        GPTConfig.from_preset("tiny", **overrides)


def test_config_dict_round_trip():
    cfg = GPTConfig.from_preset("mini", attention="gqa", num_kv_heads=2, dropout=0.1)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.head_dim == 32
    with pytest.raises(ValueError, match=r"missing GPTConfig field\(s\) \['num_heads'\]"):
        GPTConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "num_heads"})


# ------------------------------------------------------------------ forward
def test_positions_from_mask():
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 1, 2, 3], [0, 0, 0, 1], [0, 0, 1, 2]]


@pytest.mark.parametrize("kind,kv", [("mha", None), ("gqa", 2), ("mqa", None)])
def test_attention_kinds_forward_and_backward(kind, kv):
    torch.manual_seed(0)
    model = GPT(tiny_config(attention=kind, num_kv_heads=kv))
    assert model.blocks[0].attn.num_kv_heads == {"mha": 4, "gqa": 2, "mqa": 1}[kind]
    idx = torch.randint(0, 61, (2, 13))
    logits = model(idx)
    assert logits.shape == (2, 13, 61)
    logits.logsumexp(-1).mean().backward()
    assert model.token_embedding.weight.grad is not None and torch.isfinite(model.token_embedding.weight.grad).all()


def test_forward_is_causal():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    idx = torch.randint(0, 61, (1, 10))
    changed = idx.clone()
    changed[0, 6] = (idx[0, 6] + 1) % 61
    with torch.no_grad():
        a, b = model(idx), model(changed)
    # rows 0-5 run the same operations on the same values in both calls: bitwise
    assert torch.equal(a[:, :6], b[:, :6]) and not torch.allclose(a[:, 6:], b[:, 6:])


def test_dropout_only_in_training():
    torch.manual_seed(0)
    model = GPT(tiny_config(dropout=0.5))
    idx = torch.randint(0, 61, (1, 8))
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    assert torch.equal(model(idx), model(idx))


def test_init_statistics_and_tying():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("mini"))
    assert model.lm_head.weight is model.token_embedding.weight
    assert abs(model.token_embedding.weight.std().item() - 0.02) < 2e-3
    assert abs(model.blocks[0].mlp.proj.weight.std().item() - 0.02 / 8**0.5) < 1e-3
    assert model.blocks[0].attn.qkv_proj.bias.abs().sum() == 0
    untied = GPT(GPTConfig.from_preset("tiny", tie_embeddings=False))
    assert untied.lm_head.weight is not untied.token_embedding.weight
    assert untied.num_parameters() == GPT(GPTConfig.from_preset("tiny")).num_parameters() + 256 * 64


def test_forward_errors():
    model = GPT(tiny_config())
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 61\), got min 0, max 61"):
        model(torch.tensor([[0, 61]]))
    with pytest.raises(ValueError, match="33 tokens .* exceeds context_length=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(TypeError, match="integer token ids, got dtype torch.float32"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, cached \+ T\) = \(1, 3\), got \(1, 4\)"):
        model(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="one KV cache per block: 2, got 1"):
        model(torch.zeros(1, 3, dtype=torch.long), kv_caches=model.make_kv_caches(1, 8)[:1])
    with pytest.raises(ValueError, match="max_len=40 exceeds context_length=32"):
        model.make_kv_caches(1, 40)
    with pytest.raises(TypeError, match="config must be a GPTConfig"):
        GPT({"vocab_size": 3})
