"""Per-layer attention options of a GPT (``layer_attention_options``): gpt-oss style
alternating sliding-window and full layers with sinks, built per block, decoding with
caches, saved and loaded with the checkpoint, refused by the transformers export."""

from __future__ import annotations

import pytest
import torch
from support.paths import assert_paths_agree

from multihead.hf.export import check_hf_export
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig


def _config(**extra):
    return GPTConfig(vocab_size=31, context_length=16, embed_dim=16, num_layers=3, num_heads=4, num_kv_heads=2,
                     attention="gqa", attention_options={"sinks": True, "rope": True},
                     layer_attention_options=[{"window": 2}, {}], **extra)  # fmt: skip


def test_layers_follow_the_pattern_and_decode_with_caches():
    torch.manual_seed(0)
    model = GPT(_config()).double().eval()
    windows = [b.attn.sliding_window for b in model.blocks]
    assert windows == [2, None, 2] and all(b.attn.sinks is not None for b in model.blocks)
    idx = torch.randint(0, 31, (2, 9))
    full = model(idx)
    caches = model.make_kv_caches(2, 9)
    steps = [model(idx[:, :3], kv_caches=caches)] + [model(idx[:, t : t + 1], kv_caches=caches)
                                                             for t in range(3, 9)]  # fmt: skip
    assert_paths_agree(torch.cat(steps, 1), full)
    uniform = GPT(GPTConfig.from_dict({**_config().to_dict(), "layer_attention_options": None})).double().eval()
    uniform.load_state_dict(model.state_dict())
    assert not torch.allclose(uniform(idx), full)  # the windows matter


def test_saved_and_loaded_with_the_config(tmp_path):
    model = GPT(_config()).eval()
    assert _config().to_dict()["layer_attention_options"] == [{"window": 2}, {}]
    assert "layer_attention_options" not in GPTConfig(vocab_size=31, context_length=16, embed_dim=16, num_layers=1,
                                                      num_heads=4).to_dict()  # fmt: skip
    save_checkpoint(model, tmp_path / "ckpt")
    back = load_checkpoint(tmp_path / "ckpt")
    assert back.config == model.config and [b.attn.sliding_window for b in back.blocks] == [2, None, 2]
    idx = torch.randint(0, 31, (1, 6))
    assert_paths_agree(back(idx), model(idx))


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="holds 4 dicts; give 1 .. num_layers=3"):
        _config().__class__.from_dict({**_config().to_dict(), "layer_attention_options": [{}] * 4})
    with pytest.raises(TypeError, match="layer_attention_options must be a list of dicts"):
        GPTConfig.from_dict({**_config().to_dict(), "layer_attention_options": {"window": 2}})
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        GPT(GPTConfig.from_dict({**_config().to_dict(), "layer_attention_options": [{"window": 0}]}))
    plain = GPTConfig(vocab_size=31, context_length=16, embed_dim=16, num_layers=2, num_heads=4,
                      layer_attention_options=[{"window": 2}, {}])  # fmt: skip
    with pytest.raises(ValueError, match="cannot hold this model's attention options"):
        check_hf_export(GPT(plain))
