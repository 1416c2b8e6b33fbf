"""Hugging Face GPT-2 state dicts to and from a multihead GPT: names, the
Conv1D transposes, tied and untied heads, inferred configs and refusals.

Nothing is downloaded: the Hugging Face models are randomly initialised from
small GPT2Configs.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from support.hf_gpt2 import SMALL_HF, hf_model, ours_from  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model  # noqa: E402

from multihead.convert.hf_gpt2 import gpt_from_hf_state_dict, gpt_to_hf_state_dict  # noqa: E402
from multihead.models.gpt import GPT, GPTConfig  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    hf = hf_model()
    return hf, ours_from(hf)


def test_to_hf_state_dict_round_trips_into_a_fresh_hf_model(pair):
    hf, ours = pair
    fresh = GPT2LMHeadModel(GPT2Config(**SMALL_HF, attn_implementation="eager")).eval()
    sd = gpt_to_hf_state_dict(ours)
    assert set(sd) == set(hf.state_dict())
    fresh.load_state_dict(sd)
    idx = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(fresh(idx).logits, hf(idx).logits)  # one model class, equal weights: bitwise
    # and the copy is ours: writing to it does not touch the model
    sd["transformer.wte.weight"].zero_()
    assert ours.token_embedding.weight.abs().sum() > 0


def test_from_hf_state_dict_copies_weights(pair):
    hf, ours = pair
    with torch.no_grad():
        before = ours.blocks[0].attn.qkv_proj.weight.clone()
        hf.transformer.h[0].attn.c_attn.weight.add_(1.0)
        try:
            assert torch.equal(ours.blocks[0].attn.qkv_proj.weight, before)
        finally:
            hf.transformer.h[0].attn.c_attn.weight.sub_(1.0)
    assert ours.lm_head.weight is ours.token_embedding.weight
    assert all(p.requires_grad for p in ours.parameters())


def test_gpt2model_names_and_inferred_config():
    # GPT2Model has no "transformer." prefix and no lm_head; head_dim 64 is inferred.
    torch.manual_seed(0)
    cfg = GPT2Config(**{**SMALL_HF, "n_embd": 128, "n_head": 2})
    base = GPT2Model(cfg).eval()
    ours = gpt_from_hf_state_dict(base.state_dict()).eval()
    assert (ours.config.num_heads, ours.config.num_layers, ours.config.vocab_size) == (2, 2, 97)
    assert ours.config.context_length == 64 and ours.config.tie_embeddings
    idx = torch.randint(0, 97, (1, 11))
    with torch.no_grad():
        hidden = base(idx).last_hidden_state
        torch.testing.assert_close(ours(idx), hidden @ base.wte.weight.T)


def test_untied_checkpoint():
    hf = hf_model(tie_word_embeddings=False)
    assert not torch.equal(hf.lm_head.weight, hf.transformer.wte.weight)
    ours = ours_from(hf)
    assert not ours.config.tie_embeddings and ours.lm_head.weight is not ours.token_embedding.weight
    idx = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits)
    tied = GPTConfig(**{**ours.config.to_dict(), "tie_embeddings": True})
    with pytest.raises(ValueError, match="untied.*tie_embeddings=False"):
        gpt_from_hf_state_dict(hf.state_dict(), tied)


@pytest.mark.parametrize("kind,kv", [("gqa", 2), ("mqa", None)])
def test_hf_conversion_refuses_other_attention_kinds(pair, kind, kv):
    hf, _ = pair
    cfg = GPTConfig(
        vocab_size=97, context_length=64, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=kv, attention=kind
    )
    why = "one key and one value head per query head"  # the message says why GPT-2 holds no other kind
    with pytest.raises(ValueError, match=f"only for attention='mha'.*{why}.*attention='{kind}'"):
        gpt_from_hf_state_dict(hf.state_dict(), cfg)
    with pytest.raises(ValueError, match="only for attention='mha'"):
        gpt_to_hf_state_dict(GPT(cfg))


def test_hf_state_dict_errors(pair):
    hf, ours = pair
    cfg = ours.config
    sd = dict(hf.state_dict())
    sd.pop("transformer.h.1.mlp.c_fc.bias")
    with pytest.raises(ValueError, match=r"missing \['blocks.1.mlp.fc.bias'\]"):
        gpt_from_hf_state_dict(sd, cfg)
    sd = {**hf.state_dict(), "transformer.h.0.attn.extra.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="unexpected .*transformer.h.0.attn.extra.weight"):
        gpt_from_hf_state_dict(sd, cfg)
    with pytest.raises(ValueError, match=r"wrong shape.*position_embedding.weight: \(64, 64\) vs model \(32, 64\)"):
        gpt_from_hf_state_dict(hf.state_dict(), GPTConfig(**{**cfg.to_dict(), "context_length": 32}))
    with pytest.raises(ValueError, match="'transformer.wte.weight' is missing"):
        gpt_from_hf_state_dict({"foo": torch.zeros(1)}, cfg)
