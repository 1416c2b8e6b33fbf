"""``tools.causal_head_scores`` on a Hugging Face GPT-2 run through ``multihead.hf``.

A tiny random ``GPT2LMHeadModel`` built from a config (nothing downloaded)
scores as the same weights in a multihead ``GPT`` (``convert.hf_gpt2``); its
copying score equals Σλ/Σ|λ| of the whole [V, V] OV matrix formed here from
transformers' own modules with NumPy (not the [D, D] form the tool uses).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import multihead.hf  # noqa: E402
from multihead.convert.hf_gpt2 import gpt_from_hf_state_dict  # noqa: E402
from multihead.models.gpt import GPTConfig  # noqa: E402
from multihead.tools import causal_head_scores  # noqa: E402

VOCAB = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    path = tmp_path_factory.mktemp("gpt2")
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # gains other than 1, so that the norms' place in the circuit matters
        for name, p in model.named_parameters():
            if "ln_" in name and name.endswith("weight"):
                p.uniform_(0.2, 2.0)
    model.save_pretrained(path)
    return path


def full_ov_copying(model, layer: int, head: int) -> float:
    """Σλ/Σ|λ| of M = P W_U N_f W_O^h W_V^h N_l W_E^T [V, V], LayerNorms by their centred gain,
    P = I - 11ᵀ/V centring the logits."""
    sd = {k: v.double().numpy() for k, v in model.state_dict().items()}
    C, H = model.config.n_embd, model.config.n_head
    D = C // H
    centre = np.eye(C) - 1.0 / C
    E = sd["transformer.wte.weight"]  # (V, C), tied unembedding
    n_l = np.diag(sd[f"transformer.h.{layer}.ln_1.weight"]) @ centre
    n_f = np.diag(sd["transformer.ln_f.weight"]) @ centre
    w_v = sd[f"transformer.h.{layer}.attn.c_attn.weight"][:, 2 * C + head * D : 2 * C + (head + 1) * D]  # x @ W: (C, D)
    w_o = sd[f"transformer.h.{layer}.attn.c_proj.weight"][head * D : (head + 1) * D]  # (D, C)
    P = np.eye(len(E)) - 1.0 / len(E)
    M = P @ E @ n_f @ w_o.T @ w_v.T @ n_l @ E.T  # column t: the centred logits added when attending to token t
    lam = np.linalg.eigvals(M)
    return float(lam.real.sum() / np.abs(lam).sum())


def test_a_gpt2_through_the_bridge_scores_as_the_same_weights_in_a_multihead_gpt(folder):
    lm = multihead.hf.load_hf(folder, transformers.GPT2LMHeadModel)
    bare = multihead.hf.load_hf(folder)  # GPT2Model: the unembedding is the tied token embedding
    ours = gpt_from_hf_state_dict(lm.state_dict(), GPTConfig.from_hf_config(lm.config)).eval()
    want = causal_head_scores(ours, vocab_size=VOCAB, length=12, batch=4)
    assert set(want.scores) == {"previous_token", "duplicate_token", "induction", "copying"}
    for model in (lm, bare):
        got = causal_head_scores(model, vocab_size=VOCAB, length=12, batch=4)
        assert got.layer_names[-1].endswith("h.1.attn") and got.notes == []
        for role, table in want.scores.items():
            torch.testing.assert_close(got.scores[role], table, rtol=1e-4, atol=1e-5)
    for layer in range(2):
        for head in range(4):
            assert float(want.scores["copying"][layer, head]) == pytest.approx(
                full_ov_copying(lm, layer, head), abs=1e-6
            )


def test_a_model_not_on_the_bridge_and_a_too_long_sequence_are_refused(folder):
    eager = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    with pytest.raises(ValueError, match="attn_implementation='eager', not 'multihead'"):
        causal_head_scores(eager, vocab_size=VOCAB, length=4)
    lm = multihead.hf.load_hf(folder, transformers.GPT2LMHeadModel)
    with pytest.raises(ValueError, match="T = 2·length = 34 tokens do not fit the model's context of 32"):
        causal_head_scores(lm, vocab_size=VOCAB, length=17)


def test_a_llama_with_grouped_value_heads(tmp_path):
    """Attention scores from transformers' own eager weights; copying from the full [V, V] OV matrix
    with each RMSNorm as its gain, query head h reading value head h // 2."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.2, 2.0)
    model.save_pretrained(tmp_path)
    ours = multihead.hf.load_hf(tmp_path, transformers.LlamaForCausalLM)
    got = causal_head_scores(ours, vocab_size=VOCAB, length=10, batch=3)
    assert got.notes == [] and got.scores["copying"].shape == (2, 4)
    bare = causal_head_scores(multihead.hf.load_hf(tmp_path), vocab_size=VOCAB, length=10, batch=3)
    assert bare.notes == [
        "copying: LlamaModel has no unembedding (no lm_head, and its token embedding is not tied to one)"
    ]
    assert "copying" not in bare.scores
    torch.testing.assert_close(bare.scores["induction"], got.scores["induction"], rtol=1e-4, atol=1e-6)
    eager = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    from multihead.tools import repeated_random_tokens

    tokens = repeated_random_tokens(VOCAB, 10, 3)
    with torch.no_grad():
        weights = eager(tokens, output_attentions=True).attentions  # L x (B, H, T, T)
    for layer, w in enumerate(weights):
        for h in range(4):
            prev = sum(float(w[b, h, i, i - 1]) for b in range(3) for i in range(1, 20)) / (3 * 19)
            ind = sum(float(w[b, h, i, i - 9]) for b in range(3) for i in range(10, 20)) / 30
            assert float(got.scores["previous_token"][layer, h]) == pytest.approx(prev, abs=1e-5)
            assert float(got.scores["induction"][layer, h]) == pytest.approx(ind, abs=1e-5)
    sd = {k: v.double().numpy() for k, v in model.state_dict().items()}
    E, U = sd["model.embed_tokens.weight"], sd["lm_head.weight"]  # (V, C)
    for layer in range(2):
        n_l, n_f = np.diag(sd[f"model.layers.{layer}.input_layernorm.weight"]), np.diag(sd["model.norm.weight"])
        w_v, w_o = (
            sd[f"model.layers.{layer}.self_attn.v_proj.weight"],
            sd[f"model.layers.{layer}.self_attn.o_proj.weight"],
        )
        for h in range(4):
            M = (np.eye(len(U)) - 1.0 / len(U)) @ U @ n_f @ w_o[:, h * 8 : (h + 1) * 8] @ w_v[(h // 2) * 8 : (h // 2 + 1) * 8] @ n_l @ E.T  # (V, V)
            lam = np.linalg.eigvals(M)
            want = float(lam.real.sum() / np.abs(lam).sum())
            assert float(got.scores["copying"][layer, h]) == pytest.approx(want, abs=1e-6), (layer, h)
