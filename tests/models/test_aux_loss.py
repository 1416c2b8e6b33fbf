"""Models sum the attention kinds' training loss terms: ``model.aux_loss()``."""

from __future__ import annotations

import pytest
import torch

from multihead.models import BertConfig, BertEncoder, Transformer, TransformerConfig
from multihead.models.gpt import GPT, GPTConfig

# the parameters each loss term trains: MoH's router, the gated kind's gate logits
TRAINED_BY_LOSS = {"moh": ("routed_gate.weight",), "gated": ("log_alpha",)}


def _check_sum(model: torch.nn.Module, attentions: list[torch.nn.Module], kind: str) -> None:
    total = model.aux_loss()
    terms = [m.aux_loss() for m in attentions]
    assert total.shape == () and torch.isfinite(total)
    # the same terms summed in a different order from the model's: a tolerance, not bitwise
    torch.testing.assert_close(total, torch.stack(terms).sum())
    if kind not in TRAINED_BY_LOSS:
        assert float(total) == 0 and not total.requires_grad
        return
    assert float(total.detach()) > 0 and all(float(t.detach()) > 0 for t in terms)
    model.zero_grad(set_to_none=True)
    total.backward()
    for m in attentions:
        for name in TRAINED_BY_LOSS[kind]:
            grad = m.get_parameter(name).grad
            assert grad is not None and bool(grad.abs().sum() > 0), name
    model.eval()
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["moh", "gated", "mha"])
def test_gpt_sums_its_blocks_and_is_zero_in_eval(kind):
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", attention=kind, num_layers=2)).train()
    ids = torch.tensor([list(b"sum of heads"), list(b"aux loss ok!")])
    model(ids)
    _check_sum(model, [block.attn for block in model.blocks], kind)
    model(ids)  # eval mode now
    assert model.aux_loss().shape == () and float(model.aux_loss()) == 0


def test_gpt_without_a_forward_has_a_zero_of_its_dtype():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", attention="moh", num_layers=1), dtype=torch.float64)
    loss = model.aux_loss()
    assert loss.shape == () and loss.dtype == torch.float64 and float(loss) == 0


def test_gpt_training_step_with_the_aux_loss_reaches_the_router():
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", attention="moh", num_layers=2)).train()
    ids = torch.tensor([list(b"a plain training loop")])
    logits = model(ids[:, :-1])
    lm = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:])
    (lm + model.aux_loss()).backward()
    router = model.blocks[0].attn.routed_gate.weight.grad
    assert router is not None and bool(router.abs().sum() > 0)


@pytest.mark.parametrize("kind", ["moh", "mha"])
def test_bert_encoder_sums_its_layers(kind):
    torch.manual_seed(0)
    # 8 heads: MoH routes 2 of 4 candidate heads (with a single candidate its router gets no gradient)
    model = BertEncoder(BertConfig.from_preset("bert-tiny", attention=kind, num_heads=8)).train()
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102]])
    model(ids)
    _check_sum(model, [layer.attention for layer in model.layers], kind)
    model(ids)
    assert float(model.aux_loss()) == 0


@pytest.mark.parametrize("kind", ["gated", "mha"])
def test_transformer_sums_self_and_cross_attention(kind):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.from_preset("copy-task", attention=kind)).train()
    src = torch.tensor([[3, 4, 5, 6, 2], [7, 8, 2, 5, 4]])
    tgt = torch.tensor([[1, 3, 4, 5], [1, 7, 8, 2]])
    model(src, tgt)
    attentions = [layer.self_attn for layer in model.encoder]
    attentions += [m for layer in model.decoder for m in (layer.self_attn, layer.cross_attn)]
    _check_sum(model, attentions, kind)
    model(src, tgt)
    assert float(model.aux_loss()) == 0
