"""GatedHeadAttention (Voita et al. hard-concrete head gates) against the NumPy
reference: outputs, weights and gradients in float64, the sampled gate
distribution, the L0 penalty, pruning, plain-MHA parity, cache, cost,
observers, errors, the official layout and a GPT built by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.paths import assert_cached_generation_agrees, assert_paths_agree

from multihead import MultiHeadAttention
from multihead.modules.kinds.gated import GatedHeadAttention, concrete_penalty
from multihead.modules.registry import build_attention
from multihead.reference.gated import (
    gated_multihead_attention,
    hard_concrete_cdf,
    hard_concrete_eval_gate,
    hard_concrete_eval_gate_grad,
    hard_concrete_mean,
    hard_concrete_sample,
    hard_concrete_sample_grad,
    l0_penalty,
)

F64 = torch.float64
TOL = 1e-10
# closed, partly open (three), fully open
LOG_ALPHA = [-3.0, -0.8, 0.3, 1.7, 4.0]


def _module(seed=0, num_heads=5, embed_dim=25, log_alpha=LOG_ALPHA, **kw) -> GatedHeadAttention:
    torch.manual_seed(seed)
    m = GatedHeadAttention(embed_dim, num_heads, dtype=F64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
        m.log_alpha.copy_(torch.tensor(log_alpha[:num_heads], dtype=F64))
    return m.eval()


def _np(t):
    return None if t is None else t.detach().numpy()


def _reference(m, x, key=None, gates=None, key_mask=None, **kw):
    """The module's forward by the NumPy reference (gates default to the eval gates)."""
    w = m.projection_weights()
    gates = hard_concrete_eval_gate(_np(m.log_alpha)) if gates is None else gates
    mask = None if key_mask is None else _np(key_mask)[:, None, None, :]  # (B, 1, 1, S)
    out, weights = gated_multihead_attention(
        _np(x), _np(x if key is None else key), _np(w["q"][0]), _np(w["k"][0]), _np(w["v"][0]),
        _np(m.out_proj.weight), gates, b_q=_np(w["q"][1]), b_k=_np(w["k"][1]), b_v=_np(w["v"][1]),
        b_o=_np(m.out_proj.bias), num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, mask=mask, **kw,
    )  # fmt: skip
    return torch.from_numpy(out), torch.from_numpy(weights)


def _close(got, want, tol=TOL):
    got, want = got.detach().to(F64), want.detach().to(F64)
    assert got.shape == want.shape and not got.isnan().any()
    scale = max(1.0, float(want.abs().max()))
    err = float((got - want).abs().max())
    assert err <= tol * scale, f"max abs error {err:.3e} > {tol:.1e} * {scale:.3g}"


# ---------------------------------------------------------------- module vs reference


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_eval_forward_matches_reference(causal, num_kv_heads):
    m = _module(num_kv_heads=num_kv_heads)
    x = torch.randn(3, 7, 25, dtype=F64)
    pad = torch.ones(3, 7, dtype=torch.bool)
    pad[1, 5:] = False
    pad[2, :2] = False
    out, weights = m(x, is_causal=causal, key_mask=pad, return_weights=True, backend="math")
    want_out, want_w = _reference(m, x, key_mask=pad, is_causal=causal)
    _close(out, want_out)
    _close(weights, want_w)
    assert m.last_gates[0] == 0 and m.last_gates[-1] == 1 and float(m.aux_loss()) == 0


def test_cross_attention_with_other_key_width_matches_reference():
    m = _module(kdim=6, vdim=6, num_kv_heads=None)
    x, mem = torch.randn(2, 3, 25, dtype=F64), torch.randn(2, 7, 6, dtype=F64)
    _close(m(x, mem), _reference(m, x, mem)[0])


def test_training_forward_uses_the_seeded_sample():
    m = _module().train()
    x = torch.randn(2, 7, 25, dtype=F64)
    torch.manual_seed(11)
    u = torch.rand(5, dtype=F64) * (1 - 2e-6) + 1e-6
    torch.manual_seed(11)
    out = m(x, is_causal=True)
    gates = hard_concrete_sample(_np(m.log_alpha), _np(u))
    _close(m.last_gates, torch.from_numpy(gates), 1e-14)
    _close(out, _reference(m, x, gates=gates, is_causal=True)[0])
    torch.manual_seed(11)
    assert torch.equal(m(x, is_causal=True), out)  # reproducible under a seed
    assert not torch.equal(m(x, is_causal=True), out)  # a new draw per call


def _scaled_mha(m, gates):
    """Plain MHA whose out_proj columns of head h are multiplied by gates[h]."""
    mha = MultiHeadAttention(m.embed_dim, m.num_heads, num_kv_heads=m.num_kv_heads, dtype=F64).eval()
    mha.load_state_dict({k: v for k, v in m.state_dict().items() if k != "log_alpha"})
    scale = torch.as_tensor(gates, dtype=F64).repeat_interleave(m.head_dim)  # (H,) -> (H*D,)
    return mha, scale


@pytest.mark.parametrize("training", [False, True])
def test_gradients_match_reference_chain_rule(training):
    """Gating head h equals scaling out_proj's columns of head h, so every
    gradient follows from plain MHA's and the reference's dg/dlog_alpha."""
    m = _module(num_kv_heads=1).train(training)
    x = torch.randn(2, 7, 25, dtype=F64, requires_grad=True)
    R = torch.randn(2, 7, 25, dtype=F64)
    torch.manual_seed(3)
    u = _np(torch.rand(5, dtype=F64) * (1 - 2e-6) + 1e-6)
    torch.manual_seed(3)
    (m(x, is_causal=True) * R).sum().backward()
    la = _np(m.log_alpha)
    if training:
        gates, dgates = hard_concrete_sample(la, u), hard_concrete_sample_grad(la, u)
    else:
        gates, dgates = hard_concrete_eval_gate(la), hard_concrete_eval_gate_grad(la)
    mha, scale = _scaled_mha(m, gates)
    x2 = x.detach().clone().requires_grad_()
    W = mha.out_proj.weight.detach().clone()
    with torch.no_grad():
        mha.out_proj.weight.mul_(scale)
    (mha(x2, is_causal=True) * R).sum().backward()
    gW = mha.out_proj.weight.grad
    _close(x.grad, x2.grad)
    _close(m.qkv_proj.weight.grad, mha.qkv_proj.weight.grad)
    _close(m.out_proj.bias.grad, mha.out_proj.bias.grad)
    _close(m.out_proj.weight.grad, gW * scale)
    dL_dg = (gW * W).sum(0).view(5, -1).sum(1)  # (C, H*D) -> (H,)
    _close(m.log_alpha.grad, dL_dg * torch.from_numpy(dgates))


def test_gradcheck_tiny():
    m = _module(num_heads=2, embed_dim=6, log_alpha=[-0.4, 0.9])
    x = torch.randn(2, 3, 6, dtype=F64, requires_grad=True)
    la = m.log_alpha.detach().clone().requires_grad_()

    def f(x, la):
        return torch.func.functional_call(m, {"log_alpha": la}, (x,), {"is_causal": True})

    assert torch.autograd.gradcheck(f, (x, la))
    assert torch.autograd.gradcheck(f, (x.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_(), la))


# ---------------------------------------------------------------- gates and penalty


def test_sampled_gates_follow_the_hard_concrete_distribution():
    """200 000 draws per head: empirical cdf, atoms and mean against the
    reference. With a fixed seed this is deterministic; the tolerance 0.006 is
    over 5 standard deviations (sd <= 0.5 / sqrt(200 000) = 0.0011)."""
    m = _module(log_alpha=[-2.0, -0.5, 0.0, 0.8, 2.5])
    torch.manual_seed(1234)
    g = m.sample_gates(200_000).detach()  # (N, H)
    assert g.shape == (200_000, 5) and g.min() >= 0 and g.max() <= 1
    la = _np(m.log_alpha)
    for x in (0.0, 0.05, 0.25, 0.5, 0.75, 0.95):
        ecdf = (g <= x).double().mean(0).numpy()
        np.testing.assert_allclose(ecdf, hard_concrete_cdf(x, la), atol=0.006)
    np.testing.assert_allclose((g == 1).double().mean(0).numpy(), 1 - hard_concrete_cdf(1 - 1e-12, la), atol=0.006)
    np.testing.assert_allclose(g.mean(0).numpy(), hard_concrete_mean(la), atol=0.006)


def test_eval_gates_and_head_lists_match_reference():
    m = _module()
    want = hard_concrete_eval_gate(_np(m.log_alpha))
    _close(m.gate_values(), torch.from_numpy(want), 1e-14)
    assert m.closed_heads() == [0] and m.open_heads() == [1, 2, 3, 4]
    assert m.gate_values()[4] == 1.0 and not m.gate_values().requires_grad
    with torch.no_grad():
        m.log_alpha[1] = math.log(1 / 11) - 1e-6
    assert m.closed_heads() == [0, 1]


def test_l0_penalty_value_gradient_and_aux_loss():
    m = _module(l0_coef=0.3)
    pen = m.l0_penalty()
    pen.backward()
    want, grad = l0_penalty(_np(m.log_alpha), coef=0.3)
    assert abs(float(pen.detach()) - want) <= 1e-14
    _close(m.log_alpha.grad, torch.from_numpy(grad), 1e-14)
    x = torch.randn(1, 4, 25, dtype=F64)
    m.train()(x)
    aux = m.aux_loss()
    assert aux.shape == () and aux.requires_grad and abs(float(aux.detach()) - want) <= 1e-14
    m.eval()(x)
    aux = m.aux_loss()
    assert aux.shape == () and aux.dtype == F64 and float(aux) == 0 and not aux.requires_grad
    model = torch.nn.ModuleList([m, _module(seed=1, log_alpha=[0.0] * 5)])
    other = l0_penalty(np.zeros(5))[0]
    assert abs(float(concrete_penalty(model, 0.1).detach()) - 0.1 * (want + other) / 2) <= 1e-14


# ---------------------------------------------------------------- pruning and MHA parity


def test_closed_head_has_no_effect_and_can_be_removed():
    m = _module()  # head 0 closed
    x = torch.randn(2, 7, 25, dtype=F64, requires_grad=True)
    out = m(x, is_causal=True)
    out.sum().backward()
    D = m.head_dim
    assert not m.qkv_proj.weight.grad[:D].any()  # head 0's query rows get no gradient
    small = GatedHeadAttention(25, 4, head_dim=D, dtype=F64).eval()
    keep = torch.arange(D, 5 * D)
    rows = torch.cat([keep, 25 + keep, 50 + keep])  # q, k, v rows of heads 1..4
    with torch.no_grad():
        small.qkv_proj.weight.copy_(m.qkv_proj.weight[rows])
        small.qkv_proj.bias.copy_(m.qkv_proj.bias[rows])
        small.out_proj.weight.copy_(m.out_proj.weight[:, keep])
        small.out_proj.bias.copy_(m.out_proj.bias)
        small.log_alpha.copy_(m.log_alpha[1:])
    _close(small(x, is_causal=True), out, 1e-13)
    with torch.no_grad():
        m.out_proj.weight[:, :D] = 0.0  # removing its out_proj columns changes nothing
    _close(m(x, is_causal=True), out, 1e-13)


@pytest.mark.parametrize("num_kv_heads", [None, 5, 1])
def test_all_gates_one_is_plain_mha(num_kv_heads):
    m = _module(num_kv_heads=num_kv_heads, log_alpha=[3.0] * 5)
    assert m.gate_values().eq(1).all()
    mha, _ = _scaled_mha(m, [1.0] * 5)
    x = torch.randn(2, 7, 25, dtype=F64)
    a, wa = m(x, is_causal=True, return_weights=True)
    b, wb = mha(x, is_causal=True, return_weights=True)
    assert_paths_agree(a, b)
    assert_paths_agree(wa, wb)


def test_from_attention_copies_a_trained_mha():
    torch.manual_seed(0)
    mha = MultiHeadAttention(12, 4, num_kv_heads=2, qkv_bias=False, dtype=F64).eval()
    m = GatedHeadAttention.from_attention(mha, l0_coef=0.5)
    assert m.l0_coef == 0.5 and not m.training and m.num_kv_heads == 2 and m.qkv_proj.bias is None
    with torch.no_grad():
        m.log_alpha.fill_(3.0)
    x = torch.randn(2, 5, 12, dtype=F64)
    assert_paths_agree(m(x), mha(x))
    with pytest.raises(TypeError, match="MultiHeadAttention, got Linear"):
        GatedHeadAttention.from_attention(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_fully_masked_rows_and_empty_inputs_give_zeros_without_nan(backend):
    m = _module().train()
    x = torch.randn(3, 5, 25, dtype=F64, requires_grad=True)
    pad = torch.ones(3, 5, dtype=torch.bool)
    pad[1] = False
    out = m(x, key_mask=pad, backend=backend)
    out.sum().backward()
    assert torch.equal(out[1], m.out_proj.bias.detach().expand(5, 25))
    assert not x.grad[1].any() and not any(p.grad.isnan().any() for p in m.parameters())
    _close(out[0], _reference(m, x, gates=_np(m.last_gates), key_mask=pad)[0][0])
    for shape in ((0, 4, 25), (2, 0, 25)):
        e = torch.randn(shape, dtype=F64, requires_grad=True)
        y = m(e, backend=backend)
        y.sum().backward()
        assert y.shape == shape


# ---------------------------------------------------------------- cache, cost, observer, errors


def test_cached_decoding_equals_recomputation():
    m = _module(num_kv_heads=1)
    x = torch.randn(2, 9, 25, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 9)
    steps = [m(x[:, :4], is_causal=True, kv_cache=cache)]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(4, 9)]
    _close(torch.cat(steps, 1), full, 1e-12)


@pytest.mark.parametrize("num_kv_heads", [None, 1])
def test_cost_matches_parameters_and_flop_counter(num_kv_heads):
    from torch.utils.flop_counter import FlopCounterMode

    m = GatedHeadAttention(24, 4, num_kv_heads=num_kv_heads)
    cost = m.cost(9, batch=2)
    assert cost.parameters == sum(p.numel() for p in m.parameters())
    assert cost.parameters == MultiHeadAttention(24, 4, num_kv_heads=num_kv_heads).cost(9).parameters + 4
    assert cost.kv_cache_bytes_per_token == 2 * m.num_kv_heads * 6 * 2
    with FlopCounterMode(display=False) as counter:
        m(torch.randn(2, 9, 24), backend="math")
    assert cost.total_flops == counter.get_total_flops()
    assert m.cost(8, causal=True).core_flops * 64 == m.cost(8).core_flops * 36


def test_observer_receives_the_gated_weights():
    m = _module()
    events = []
    handle = m.register_attention_observer(lambda mod, ev: events.append(ev))
    x = torch.randn(2, 7, 25, dtype=F64)
    out, weights = m(x, is_causal=True, return_weights=True)
    handle.remove()
    (ev,) = events
    assert ev.kind == "gated" and torch.equal(ev.weights, weights)
    _close(ev.weights, _reference(m, x, is_causal=True)[1])
    sums = ev.weights.sum(-1)  # rows sum to the gate
    _close(sums, m.gate_values()[None, :, None].expand_as(sums), 1e-13)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"temperature": 0.0}, "temperature=0.0"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"stretch": (0.0, 1.1)}, r"stretch=\(0.0, 1.1\)"),
        ({"stretch": (-0.1, 1.0)}, "low < 0 and high > 1"),
        ({"stretch": "ab"}, "stretch='ab'"),
        ({"eps": 0.5}, "eps=0.5"),
        ({"l0_coef": -1.0}, "l0_coef=-1.0"),
        ({"dropout": 1.0}, "dropout=1.0"),
    ],
)
def test_construction_errors_name_the_values(kw, match):
    with pytest.raises(ValueError, match=match):
        GatedHeadAttention(8, 2, **kw)


def test_builder_and_sizes_errors():
    with pytest.raises(ValueError, match="embed_dim=10 is not divisible by num_heads=4"):
        build_attention("gated", embed_dim=10, num_heads=4)
    with pytest.raises(TypeError, match=r"'gated' has no option 'shared_heads'; its options: alibi, device, dropout, dtype, eps"):
        build_attention("gated", embed_dim=8, num_heads=2, shared_heads=1)
    m = build_attention("gated", embed_dim=8, num_heads=2, stretch=[-0.2, 1.2], num_kv_heads=1)
    assert isinstance(m, GatedHeadAttention) and m.kind == "gated" and m.stretch == (-0.2, 1.2)
    with pytest.raises(ValueError, match=r"\(B, T, 8\)"):
        m(torch.randn(2, 3, 5))


def test_low_precision_gates_are_computed_in_float32():
    m = GatedHeadAttention(16, 4, dtype=torch.bfloat16).train()
    out = m(torch.randn(2, 5, 16, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert m.last_gates.dtype == torch.float32 and m.aux_loss().dtype == torch.float32


# ---------------------------------------------------------------- official layout and GPT


def _official_forward(p, x, mask, H):
    """Voita's MultiHeadAttn combined format, from the spec: TF (in, out)
    weights, additive -1e9 (1 - m) mask, eval gate on log_a."""
    B, n, C = x.shape
    d = C // H
    qkv = x @ p["mem_conv/W"] + p["mem_conv/b"]
    q, k, v = (qkv[..., i * C : (i + 1) * C].reshape(B, n, H, d).transpose(0, 2, 1, 3) for i in range(3))
    logits = (q / math.sqrt(d)) @ k.transpose(0, 1, 3, 2) + (-1e9) * (1 - mask)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    s = 1 / (1 + np.exp(-p["gate/log_a"]))
    g = np.clip(s * 1.2 - 0.1, 0, 1)  # (1, H, 1, 1)
    heads = g * (w @ v)
    return heads.transpose(0, 2, 1, 3).reshape(B, n, C) @ p["out_conv/W"] + p["out_conv/b"]


def test_from_voita_state_dict_matches_the_official_forward():
    rng = np.random.default_rng(0)
    C, H = 12, 4
    p = {
        "mem_conv/W": rng.standard_normal((C, 3 * C)) * 0.4, "mem_conv/b": rng.standard_normal(3 * C) * 0.4,
        "out_conv/W": rng.standard_normal((C, C)) * 0.4, "out_conv/b": rng.standard_normal(C) * 0.4,
        "gate/log_a": np.array([-3.0, -0.5, 0.4, 3.0]).reshape(1, H, 1, 1),
    }  # fmt: skip
    m = GatedHeadAttention.from_voita_state_dict(p, num_heads=H).eval()
    x = rng.standard_normal((2, 7, C))
    mask = np.tril(np.ones((7, 7)))[None, None]  # (1, 1, n, n), 1 = attend
    want = _official_forward(p, x, mask, H)
    _close(m(torch.from_numpy(x), is_causal=True), torch.from_numpy(want))
    with pytest.raises(ValueError, match="missing official parameters"):
        GatedHeadAttention.from_voita_state_dict({}, num_heads=H)
    with pytest.raises(ValueError, match="num_heads=3"):
        GatedHeadAttention.from_voita_state_dict(p, num_heads=3)


def test_gpt_by_name_generates_the_same_with_and_without_cache():
    from multihead.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", attention="gated", attention_options={"l0_coef": 0.5})).eval()
    assert all(isinstance(b.attn, GatedHeadAttention) for b in model.blocks)
    idx = torch.randint(0, 256, (2, 5))
    assert_cached_generation_agrees(model, idx, 6)
    model.train()
    logits = model(idx)
    loss = logits.logsumexp(-1).mean() + concrete_penalty(model, 0.1)
    loss.backward()
    assert model.blocks[0].attn.log_alpha.grad.abs().sum() > 0


# ---------------------------------------------------------------- rope / qk_norm (beyond tests/modules/test_contract.py)
def test_options_off_are_bitwise_unchanged_in_training():
    """Sampled gates from the same seed: the same operations on the same shapes, bitwise."""
    plain = _module(embed_dim=30, num_kv_heads=1).train()
    off = GatedHeadAttention(30, 5, num_kv_heads=1, rope=False, qk_norm=False, dtype=F64).train()
    off.load_state_dict(plain.state_dict())
    x = torch.randn(2, 7, 30, dtype=F64)
    torch.manual_seed(5)
    a, wa = plain(x, is_causal=True, return_weights=True)
    torch.manual_seed(5)
    b, wb = off(x, is_causal=True, return_weights=True)
    assert torch.equal(a, b) and torch.equal(wa, wb)


def test_builder_and_from_attention_pass_rope_and_qk_norm():
    m = build_attention("gated", embed_dim=24, num_heads=4, rope={"rotary_dim": 4}, qk_norm=True)
    assert isinstance(m, GatedHeadAttention) and m.rope["rotary_dim"] == 4 and m.qk_norm is not None
    torch.manual_seed(0)
    mha = MultiHeadAttention(24, 4, num_kv_heads=2, rope={"interleaved": True}, qk_norm=True, dtype=F64).eval()
    with torch.no_grad():
        mha.qk_norm.q_norm.weight.uniform_(0.5, 1.5)
    g = GatedHeadAttention.from_attention(mha)
    assert g.rope.options == mha.rope.options and torch.equal(g.qk_norm.q_norm.weight, mha.qk_norm.q_norm.weight)
    with torch.no_grad():
        g.log_alpha.fill_(3.0)  # all gates 1: the same function as the MHA
    x = torch.randn(2, 5, 24, dtype=F64)
    assert_paths_agree(g(x, is_causal=True), mha(x, is_causal=True))
    off = GatedHeadAttention.from_attention(mha, rope=False, qk_norm=False)
    assert off.rope is None and off.qk_norm is None
    on = GatedHeadAttention.from_attention(MultiHeadAttention(24, 4), rope=True, qk_norm=True)
    assert on.rope is not None and on.qk_norm.k_norm.weight.eq(1).all()


def test_defaults_gates_start_symmetric_and_the_penalty_coefficient_is_one():
    """catches: log_alpha started at one value instead of uniform(-b, b); other defaults of cost and
    concrete_penalty."""
    torch.manual_seed(0)
    m = GatedHeadAttention(64, 16)
    a = m.log_alpha.detach()
    assert float(a.min()) < 0 < float(a.max()) and a.unique().numel() == a.numel()
    assert m.cost(4) == m.cost(4, batch=1)
    model = torch.nn.Sequential(m)
    assert_paths_agree(concrete_penalty(model), concrete_penalty(model, 1.0))
    assert_paths_agree(concrete_penalty(model), m.l0_penalty())
