"""run_with_cache through the Hugging Face bridge: the same names as on multihead's
own models, equal to them on the same weights (a tiny random GPT-2, nothing
downloaded), and GQA keys/values at G heads (a tiny Llama)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from support.hf_gpt2 import hf_model, ours_from  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import multihead.hf  # noqa: E402, F401  (registers "multihead")
from multihead.tools import ACTIVATION_NAMES, run_with_cache  # noqa: E402

ALL = tuple(n for n in ACTIVATION_NAMES if n not in ("q_pre", "k_pre"))  # pre-rope: multihead's own layers only
TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture(scope="module")
def gpt2_pair():
    hf = hf_model(seed=3)
    ours = ours_from(hf)
    hf.set_attn_implementation("multihead")
    return hf, ours


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=32,
                         attn_implementation="multihead")  # fmt: skip
    return LlamaForCausalLM(config).eval()


def test_hf_gpt2_gives_the_multihead_gpt_activations(gpt2_pair):
    hf, ours = gpt2_pair
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    out_hf, theirs = run_with_cache(hf, ids, names=ALL)
    out_ours, mine = run_with_cache(ours, ids, names=ALL)
    assert theirs.keys() == mine.keys() and len(mine) == 2 * len(ALL)
    for key in mine.keys():
        torch.testing.assert_close(theirs[key], mine[key], **TOL, msg=key)
    torch.testing.assert_close(out_hf.logits, out_ours, **TOL)
    _, theirs = run_with_cache(hf, ids, names=["pattern", "z", "k"], heads=[1, 3], layers=[1])
    _, mine = run_with_cache(ours, ids, names=["pattern", "z", "k"], heads=[1, 3], layers=[1])
    assert set(theirs.keys()) == set(mine.keys()) == {"layers.1.k", "layers.1.pattern", "layers.1.z"}
    assert theirs.kv_heads == mine.kv_heads == {1: (1, 3)}
    for key in mine.keys():
        assert theirs[key].shape[1] == 2
        torch.testing.assert_close(theirs[key], mine[key], **TOL, msg=key)


def test_llama_gqa_keys_and_values_stay_at_g_heads():
    model = _llama()
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(1))
    _, acts = run_with_cache(model, ids, names=ALL)
    B, T, H, G, D = 2, 5, 6, 2, 4
    for i, layer in enumerate(model.model.layers):
        q, k, v = acts[f"layers.{i}.q"], acts[f"layers.{i}.k"], acts[f"layers.{i}.v"]
        assert q.shape == (B, H, T, D) and k.shape == v.shape == (B, G, T, D)
        # q and k are the rotated ones the scores use: they give the pattern (query head h reads h // 3)
        scores = q @ k.repeat_interleave(H // G, dim=1).transpose(-1, -2) * D**-0.5
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        pattern = acts[f"layers.{i}.pattern"]
        torch.testing.assert_close(pattern, scores.softmax(-1), **TOL)
        torch.testing.assert_close(acts[f"layers.{i}.z"], pattern @ v.repeat_interleave(H // G, dim=1), **TOL)
        z = acts[f"layers.{i}.z"].transpose(1, 2).reshape(B, T, H * D)  # (B, H, T, D) -> (B, T, H*D)
        torch.testing.assert_close(layer.self_attn.o_proj(z), acts[f"layers.{i}.attn_out"], **TOL)
        torch.testing.assert_close(acts[f"layers.{i}.resid_pre"], acts[f"layers.{i - 1}.resid_post"] if i else
                                   model.model.embed_tokens(ids))  # fmt: skip
    _, some = run_with_cache(model, ids, names=["k", "v"], heads=[4])
    assert some.kv_heads == {0: (1,), 1: (1,)}
    torch.testing.assert_close(some["layers.0.v"], acts["layers.0.v"][:, [1]])


def test_hf_refusals_are_one_line_and_before_the_run(gpt2_pair):
    hf, _ = gpt2_pair
    ids = torch.zeros(1, 3, dtype=torch.long)
    cases = [
        ({"layers": [2]}, r"asks for layer 2, but the model has 2 attention modules"),
        ({"heads": [4]}, r"heads=\[4\] asks for head 4, but GPT2LMHeadModel has 4 heads"),
        ({"names": ["attn_pattern"]}, r"valid names: \['q', 'k'"),
        ({"names": ["q", "q_pre"]}, r"\['q_pre'\] are recorded in multihead's own layers only"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            run_with_cache(hf, ids, **kwargs)
        assert "\n" not in str(err.value)
    eager = hf_model(seed=3)  # attn_implementation="eager"
    with pytest.raises(ValueError, match="runs attn_implementation='eager', not 'multihead'"):
        run_with_cache(eager, ids)


def test_weights_are_formed_only_in_the_layers_asked_for(gpt2_pair, monkeypatch):
    import multihead.hf.bridge as bridge

    hf, _ = gpt2_pair
    asked = []
    real = bridge.attention

    def spy(*args, return_weights=False, **kwargs):
        asked.append(return_weights)
        return real(*args, return_weights=return_weights, **kwargs)

    monkeypatch.setattr(bridge, "attention", spy)
    ids = torch.randint(0, 97, (1, 4), generator=torch.Generator().manual_seed(2))
    _, acts = run_with_cache(hf, ids, names=["pattern", "q"], layers=[1], heads=[2])
    assert acts.keys() == ["layers.1.q", "layers.1.pattern"] and acts["layers.1.pattern"].shape == (1, 1, 4, 4)
    assert asked[0] is False and asked[1].heads == (2,)  # layer 0 forms no weights; layer 1 head 2's only
    asked.clear()
    run_with_cache(hf, ids, names=["q", "z"])
    assert asked == [False, False]  # no pattern asked: the fused kernel alone
