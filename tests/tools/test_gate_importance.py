"""tools.gate_importance: hard-concrete gates trained on a model's heads.

* the gates act where the "gated" kind's do: a model whose attention is
  rebuilt as GatedHeadAttention with the learned log_alpha computes what the
  head hook computes with the same eval gates;
* a head made useless (its out_proj input columns zeroed) closes under the L0
  penalty while the heads that matter stay open, and it comes first in the
  closing order;
* with penalty 0 and the model's own outputs as the target the gates stay
  open (nothing to gain by closing);
* the model's parameters, their .grad and the modules' modes are untouched.
"""

from __future__ import annotations

import pytest
import torch

from multihead.models.gpt import GPT, GPTConfig
from multihead.modules import hard_concrete
from multihead.modules.kinds.gated import GatedHeadAttention
from multihead.tools.distill import distillation
from multihead.tools.gate_importance import GateSweep, GateTraining, gate_sweep
from multihead.tools.heads import attention_layers
from multihead.tools.importance import head_importance
from multihead.tools.prune import prune_heads

F64 = torch.float64
V, T, L, H = 11, 8, 2, 4


def _gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=V, context_length=T, embed_dim=16, num_layers=L, num_heads=H), dtype=F64)
    with torch.no_grad():
        for p in model.parameters():  # random weights everywhere (biases included): every head matters
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def _batches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (4, T), generator=g) for _ in range(n)]


def _logits(model, x):
    return model(x)


def _kill(model: GPT, layer: int, head: int) -> None:
    """Zero head ``head``'s input columns of layer ``layer``'s out_proj: the head contributes nothing."""
    D = model.config.embed_dim // H
    with torch.no_grad():
        attention_layers(model)[layer].out_proj.weight[:, head * D : (head + 1) * D] = 0


def test_gates_act_where_the_gated_kind_does():
    model = _gpt()
    pairs, loss = distillation(model, _batches(), _logits, objective="kl")
    sweep = gate_sweep(model, pairs, loss, GateTraining(penalties=(0.5,), steps=30, lr=0.2))
    # A copy whose attention is GatedHeadAttention with log_alpha set so that its eval gates equal the sweep's.
    log_alpha = torch.logit(((sweep.gates[0] + 0.1) / 1.2).clamp(1e-12, 1 - 1e-12))  # inverse of the eval gate
    gated = _gpt()
    for i, block in enumerate(gated.blocks):
        g = GatedHeadAttention.from_attention(block.attn)
        with torch.no_grad():
            g.log_alpha.copy_(log_alpha[i])
        block.attn = g
    gated.eval()
    torch.testing.assert_close(hard_concrete.eval_gates(log_alpha), sweep.gates[0], rtol=0, atol=1e-9)
    x = pairs[0][0]
    with torch.no_grad():
        want = gated(x)
        from multihead.tools.gate_importance import _gated  # the hook gate_sweep uses

        with _gated(attention_layers(model), lambda i: sweep.gates[0][i]):
            got = model(x)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(got, model(x))  # the gates changed something


def test_a_useless_head_closes_first():
    model = _gpt()
    _kill(model, 1, 2)
    pairs, loss = distillation(model, _batches(), _logits, objective="kl")
    sweep = gate_sweep(model, pairs, loss, GateTraining(penalties=(0.02,), steps=80, lr=0.2))
    assert sweep.closed() == {1: [2]}
    assert sweep.closing_order()[0] == (1, 2)
    assert sweep.open_probability[0, 1, 2] < 0.2
    others = torch.ones(L, H, dtype=torch.bool)
    others[1, 2] = False
    assert bool((sweep.open_probability[0][others] > 0.8).all())
    assert sweep.loss[0] < 1e-6  # only the useless head closed: the outputs are kept


def test_sweep_rows_and_scores():
    model = _gpt()
    _kill(model, 0, 1)
    pairs, loss = distillation(model, _batches(), _logits, objective="kl")
    training = GateTraining(penalties=(0.0, 0.05, 5.0), steps=60, lr=0.2)
    sweep = gate_sweep(model, pairs, loss, training)
    assert isinstance(sweep, GateSweep) and sweep.penalties == (0.0, 0.05, 5.0)
    assert sweep.open_probability.shape == sweep.gates.shape == (3, L, H)
    assert sweep.open_probability.dtype == F64
    assert bool((sweep.gates[0] == 1).all()) and sweep.loss[0] < 1e-6  # no penalty: all stay open
    closed = [sum(len(h) for h in sweep.closed(i).values()) for i in range(3)]
    assert closed[0] == 0 and closed[1] >= 1 and closed[2] > closed[1]
    assert sweep.loss[2] > sweep.loss[1]  # closing heads that matter costs fidelity
    # P(open) and the eval gates both come from each head's log_alpha (Louizos et al.,
    # eq. 12 and the test-time estimator); recover log_alpha from P(open) and
    # check that it gives the eval gates (catches: a P(open) without the T ln(-low/high) shift)
    p = sweep.open_probability
    inside = (p > 2e-6) & (p < 1 - 2e-6)  # not clipped to [eps, 1 - eps]
    log_alpha = torch.logit(p) + 0.33 * torch.log(torch.tensor(0.1 / 1.1, dtype=F64))
    eval_gates = (torch.sigmoid(log_alpha) * 1.2 - 0.1).clamp(0, 1)
    torch.testing.assert_close(eval_gates[inside], sweep.gates[inside], rtol=0, atol=1e-5)
    assert bool((sweep.gates[p <= 2e-6] == 0).all()) and bool((sweep.gates[p >= 1 - 2e-6] == 1).all())
    assert inside.sum() >= 4  # the check saw heads whose gates are neither clipped
    scores = head_importance(model, pairs, loss, method="gates", gate_training=training)
    # same operations, same seed, same inputs: bitwise
    torch.testing.assert_close(scores, sweep.scores, rtol=0, atol=0)


def test_layers_of_different_head_counts():
    model = _gpt()
    prune_heads(model, {0: [1, 3]})  # layer 0 keeps 2 heads, layer 1 all 4
    pairs, loss = distillation(model, _batches(1), _logits)
    sweep = gate_sweep(model, pairs, loss, GateTraining(penalties=(1.0,), steps=5))
    assert sweep.open_probability.shape == (1, L, H)
    assert bool(sweep.open_probability[0, 0, 2:].isnan().all()) and bool(sweep.gates[0, 0, 2:].isnan().all())
    assert not bool(sweep.open_probability[0, 1].isnan().any())
    assert len(sweep.closing_order()) == 6 and all(h < 2 for layer, h in sweep.closing_order() if layer == 0)


def test_model_untouched():
    model = _gpt()
    model.train()
    model.blocks[0].train(False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    state = torch.random.get_rng_state()
    pairs, loss = distillation(model, _batches(1), _logits)
    gate_sweep(model, pairs, loss, GateTraining(penalties=(1.0,), steps=3))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.random.get_rng_state(), state)  # the noise has its own generator


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"penalties": ()}, "penalties must be a non-empty sequence"),
        ({"penalties": "0.1"}, "penalties must be a non-empty sequence"),
        ({"penalties": (0.1, -1.0)}, r"every penalty must be a finite float >= 0, got penalties=\(0.1, -1.0\)"),
        ({"penalties": (float("nan"),)}, "every penalty"),
        ({"steps": 0}, "steps must be an int >= 1, got steps=0"),
        ({"steps": 2.5}, "steps must be an int"),
        ({"lr": 0.0}, "lr must be > 0, got lr=0.0"),
        ({"init": float("inf")}, "init must be a finite float"),
        ({"seed": "a"}, "seed must be an int"),
    ],
)
def test_training_options_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GateTraining(**kwargs)


def test_one_penalty_may_be_a_float():
    assert GateTraining(penalties=0.2).penalties == (0.2,)


def test_usage_errors():
    model = _gpt()
    pairs, loss = distillation(model, _batches(1), _logits)
    with pytest.raises(ValueError, match="gate_training applies to method='gates' only"):
        head_importance(model, pairs, loss, method="gradient", gate_training=GateTraining())
    with pytest.raises(TypeError, match="gate_training must be a GateTraining, got dict"):
        head_importance(model, pairs, loss, method="gates", gate_training={"steps": 2})
    with pytest.raises(ValueError, match="token_mask applies to method='gradient' only"):
        head_importance(model, pairs, loss, method="gates", token_mask=lambda b: None)
    with pytest.raises(ValueError, match="batches is empty"):
        gate_sweep(model, [], loss)

    def detached(m, pair):
        return loss(m, pair).detach()

    with pytest.raises(ValueError, match="no gradient path to the attention heads"):
        gate_sweep(model, pairs, detached, GateTraining(steps=1))

    def first_block_only(m, pair):
        return m.blocks[0](m.token_embedding(pair[0])).sum()

    with pytest.raises(ValueError, match=r"attention layers \[1\] never ran"):
        gate_sweep(model, pairs, first_block_only, GateTraining(steps=1))
