"""tools.objectives: the losses heads are scored on, and the scores of one text.

The references are written out here with plain torch (cross-entropy of the
shifted ids, a head's columns of out_proj zeroed); the same operations run
in both, so results agree to float32 rounding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import multihead.tools as tools
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.objectives import embedding_distance, gpt_importance, gpt_scores, lm_loss, next_token_logits


@pytest.fixture(scope="module")
def gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.from_preset("tiny", context_length=16)).eval()


def test_the_objectives_are_exported_from_tools():
    for name in ("lm_loss", "next_token_logits", "embed", "contrastive_loss", "gpt_scores", "encoder_scores",
                 "gate_training", "gpt_importance", "encoder_importance"):  # fmt: skip
        assert getattr(tools, name) is getattr(tools.objectives, name) and name in tools.__all__


def test_lm_loss_is_the_cross_entropy_of_the_next_tokens(gpt):
    x = torch.randint(0, 256, (3, 9))  # (B, T)
    logits = next_token_logits(gpt, x)
    assert logits.shape == (3, 8, 256)  # the last token predicts nothing here
    with torch.no_grad():
        want = F.cross_entropy(gpt(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        torch.testing.assert_close(lm_loss(gpt, x), want)


def test_gpt_importance_is_the_loss_increase_with_one_head_masked(gpt):
    ids = torch.tensor([list(b"To be, or not")])  # (1, T)
    scores = gpt_importance(gpt, ids)
    L, H = gpt.config.num_layers, gpt.config.num_heads
    assert scores.shape == (L, H) and scores.dtype == torch.float64
    D = gpt.config.embed_dim // H
    with torch.no_grad():
        base = float(lm_loss(gpt, ids))
        for layer, head in ((0, 0), (L - 1, H - 1)):
            masked = copy.deepcopy(gpt)
            masked.blocks[layer].attn.out_proj.weight[:, head * D : (head + 1) * D] = 0  # (C, H*D)
            assert float(scores[layer, head]) == pytest.approx(float(lm_loss(masked, ids)) - base, rel=1e-4, abs=1e-6)


def test_gpt_importance_needs_two_tokens(gpt):
    with pytest.raises(ValueError, match="the text has 1 token, give at least 2"):
        gpt_importance(gpt, torch.tensor([[65]]))


def test_gradient_scores_are_normalised_per_layer(gpt):
    batches = [torch.randint(0, 256, (2, 8)) for _ in range(2)]
    scores = gpt_scores(gpt, "gradient", batches)
    assert scores.shape == (gpt.config.num_layers, gpt.config.num_heads)
    torch.testing.assert_close(scores.norm(dim=1), torch.ones(gpt.config.num_layers, dtype=torch.float64))


def test_embedding_distance_is_one_minus_cosine():
    ref = torch.tensor([[1.0, 0.0]])  # (1, C)
    distance = embedding_distance(ref)
    assert float(distance(torch.tensor([[2.0, 0.0]]))) == pytest.approx(0.0, abs=1e-12)
    assert float(distance(torch.tensor([[0.0, 3.0]]))) == pytest.approx(1.0)
    assert float(distance(torch.tensor([[-1.0, 0.0]]))) == pytest.approx(2.0)
