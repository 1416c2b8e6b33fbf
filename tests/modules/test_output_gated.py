"""``output_gated`` attention against its NumPy float64 reference (Qiu et al. 2025,
position G1): outputs, weights and gradients, headwise and elementwise, GQA,
odd sizes (T = 7, D = 5), cross-attention, cached decoding, head selection,
cost, options; and the kind by name in a GPT, from the command line to the
head explorer. The contract tests (tests/modules/test_contract*.py) cover the
rest of the shared interface."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.attention import assert_matches
from support.cli import quietly
from support.paths import assert_cached_generation_agrees, assert_paths_agree

from multihead import build_attention
from multihead.commands.inspect import inspect_text
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.kinds.mha import MultiHeadAttention
from multihead.modules.kinds.output_gated import OutputGatedAttention
from multihead.reference.output_gated import output_gated_attention
from multihead.tools.heads import mask_heads
from multihead.tools.prune import prune_heads

F64 = torch.float64
C, H, D = 12, 4, 5  # head_dim 5 != C / H: the widths are decoupled


def build(gate="elementwise", G=2, seed=0, **options) -> OutputGatedAttention:
    torch.manual_seed(seed)
    m = build_attention("output_gated", embed_dim=C, num_heads=H, num_kv_heads=G, head_dim=D, gate=gate,
                        dtype=F64, **options)  # fmt: skip
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m.eval()


def paper_weights(m: OutputGatedAttention) -> dict[str, np.ndarray]:
    """The module's parameters in the reference's (paper's) notation: X W, row vectors."""
    E, G = m.gate_width, m.num_kv_heads
    W, b = m.qkv_proj.weight.detach().numpy(), m.qkv_proj.bias.detach().numpy()
    cuts = np.cumsum([H * D, H * E, G * D])
    names = ("Q", "theta", "K", "V")
    w = {f"W_{n}": part.T for n, part in zip(names, np.split(W, cuts))}
    w.update({f"b_{n}": part for n, part in zip(names, np.split(b, cuts))})
    w.update(W_O=m.out_proj.weight.detach().numpy().T, b_O=m.out_proj.bias.detach().numpy())
    return w


def reference(m, x, key=None, **kw):
    out, p = output_gated_attention(x.detach().numpy(), num_heads=H, num_kv_heads=m.num_kv_heads,
                                    X_kv=None if key is None else key.detach().numpy(), **paper_weights(m), **kw)  # fmt: skip
    return torch.from_numpy(out), torch.from_numpy(p)


def _x(B=2, T=7, seed=1):
    return torch.randn(B, T, C, dtype=F64, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("G", [4, 2, 1])
@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_self_attention_matches_the_reference(gate, G):
    m = build(gate, G)
    assert m.gate_width == (1 if gate == "headwise" else D)
    x = _x()
    out, w = m(x, is_causal=True, return_weights=True)
    want, want_w = reference(m, x, is_causal=True)
    assert_matches(out, want)
    assert_matches(w, want_w)  # the softmax probabilities: the gate acts after them
    assert_matches(m(x, is_causal=True, backend="math"), want)


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_cross_attention_with_a_mask_matches_the_reference(gate):
    m = build(gate)
    x, mem = _x(T=3), _x(T=6, seed=2)
    allow = torch.rand(3, 6, generator=torch.Generator().manual_seed(3)) > 0.3
    allow[:, 0] = True
    assert_matches(m(x, mem, attn_mask=allow), reference(m, x, mem, mask=allow.numpy())[0])


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_gradients_match_the_references_directional_derivatives(gate):
    """d/dε <ref(x + ε u), g> by central differences against <∂/∂x <m(x), g>, u>; the same along the gate rows."""
    m = build(gate)
    x = _x().requires_grad_(True)
    g = torch.randn(2, 7, C, dtype=F64, generator=torch.Generator().manual_seed(5))
    (m(x, is_causal=True) * g).sum().backward()
    u = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(6))
    eps = 1e-5

    def f(x_, mod=m):
        return float((reference(mod, x_, is_causal=True)[0] * g).sum())

    fd = (f(x.detach() + eps * u) - f(x.detach() - eps * u)) / (2 * eps)
    assert abs(float((x.grad * u).sum()) - fd) <= 1e-7 * max(1.0, abs(fd))
    rows = slice(H * D, H * (D + m.gate_width))  # W_θ: the gate logits' rows of qkv_proj
    du = torch.zeros_like(m.qkv_proj.weight)
    du[rows] = torch.randn(du[rows].shape, dtype=F64, generator=torch.Generator().manual_seed(7))
    plus, minus = build(gate), build(gate)
    with torch.no_grad():
        plus.qkv_proj.weight += eps * du
        minus.qkv_proj.weight -= eps * du
    fd = (f(x.detach(), plus) - f(x.detach(), minus)) / (2 * eps)
    assert abs(float((m.qkv_proj.weight.grad * du).sum()) - fd) <= 1e-7 * max(1.0, abs(fd))
    assert m.qkv_proj.weight.grad[rows].abs().sum() > 0


def test_gradcheck_tiny():
    m = build("headwise")
    x = _x(B=1, T=3).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: m(t, is_causal=True), (x,))


def test_open_gates_are_plain_attention_with_the_same_weights():
    """With the gate logits pinned high (σ = 1) the layer is the MHA/GQA of its q, k, v rows."""
    m = build("elementwise", rope={"rotary_dim": 4}, qk_norm=True)
    with torch.no_grad():
        m.qkv_proj.weight[H * D : 2 * H * D] = 0
        m.qkv_proj.bias[H * D : 2 * H * D] = 60.0
    mha = MultiHeadAttention(C, H, num_kv_heads=2, head_dim=D, rope={"rotary_dim": 4}, qk_norm=True, dtype=F64).eval()
    keep = torch.cat([torch.arange(H * D), torch.arange(2 * H * D, m.qkv_proj.weight.shape[0])])
    mha.load_state_dict({"qkv_proj.weight": m.qkv_proj.weight[keep], "qkv_proj.bias": m.qkv_proj.bias[keep],
                         **{k: v for k, v in m.state_dict().items() if not k.startswith("qkv_proj")}})  # fmt: skip
    x = _x()
    assert_paths_agree(m(x, is_causal=True), mha(x, is_causal=True))
    with torch.no_grad():
        m.qkv_proj.bias[H * D : 2 * H * D] = -60.0  # closed gates: only out_proj's bias is left
    assert_paths_agree(m(x, is_causal=True), m.out_proj.bias.expand(2, 7, C))


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_cached_decoding_with_norms_and_partial_rope_equals_full(gate):
    m = build(gate, rope={"rotary_dim": 2, "base": 500.0}, qk_norm=True, qk_norm_unit_offset=True, qk_norm_eps=1e-4)
    x = _x()
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 7)
    steps = [m(x[:, :3], is_causal=True, kv_cache=cache)]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(3, 7)]
    assert cache.k.shape == cache.v.shape == (2, 2, 7, D)  # no gates: they come from the queries
    assert_paths_agree(torch.cat(steps, dim=1), full)


def test_unit_offset_norm_gains_are_one_plus_the_weight():
    m = build(qk_norm=True, qk_norm_unit_offset=True, qk_norm_eps=1e-4)
    fresh = build_attention("output_gated", embed_dim=C, num_heads=H, qk_norm=True, qk_norm_unit_offset=True)
    assert not fresh.qk_norm.q_norm.weight.any()  # zeros: gains of one at construction
    plain = build(qk_norm=True, qk_norm_eps=1e-4)
    state = m.state_dict()
    plain.load_state_dict({k: v + 1 if k.startswith("qk_norm.") else v for k, v in state.items()})
    assert plain.qk_norm.q_norm.eps == m.qk_norm.q_norm.eps == 1e-4
    x = _x()
    assert_paths_agree(m(x, is_causal=True), plain(x, is_causal=True))


@pytest.mark.parametrize("heads", [[1], [0, 3], [2, 3]])
def test_headwise_selected_heads_equal_the_others_masked(heads):
    m = build("headwise", rope={"rotary_dim": 4}, qk_norm=True, qk_norm_unit_offset=True)
    small = m.select_heads(heads)
    assert small.gate == "headwise" and small.qk_norm.q_norm.unit_offset
    x = _x()
    with mask_heads(m, {0: [h for h in range(H) if h not in heads]}):
        want = m(x, is_causal=True)
    assert_paths_agree(small(x, is_causal=True), want)
    part = m.tensor_parallel_part(heads) if heads in ([0, 1], [2, 3]) else None
    if part is not None:  # a contiguous block splits as select_heads keeps it
        assert_paths_agree(part(x, is_causal=True), small(x, is_causal=True))


def test_a_pruned_gpt_equals_the_masked_one_and_reloads(tmp_path):
    """prune_heads on a GPT of output-gated GQA layers: the masked model's outputs, the config's
    per-layer head counts, a checkpoint that rebuilds it, and cached decoding."""
    config = GPTConfig(vocab_size=37, context_length=16, embed_dim=24, num_layers=2, num_heads=6, num_kv_heads=3,
                       attention="output_gated", attention_options={"gate": "headwise", "qk_norm": True})  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config, dtype=F64).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(1))
    table = {0: [2, 3], 1: [0, 3, 5]}  # a whole group; one head of every group
    with torch.no_grad(), mask_heads(model, table):
        want = model(idx)
    prune_heads(model, table)
    with torch.no_grad():
        assert_paths_agree(model(idx), want)
    assert [(b.attn.num_heads, b.attn.num_kv_heads) for b in model.blocks] == [(4, 2), (3, 3)]
    save_checkpoint(model, tmp_path / "pruned")
    loaded = load_checkpoint(tmp_path / "pruned").eval()
    assert loaded.blocks[1].attn.gate == "headwise"
    with torch.no_grad():
        assert_paths_agree(loaded(idx), want)
    assert_cached_generation_agrees(loaded, idx[:, :4], 3)


def test_observers_get_the_softmax_and_head_hooks_the_gated_outputs():
    m = build("headwise")
    x = _x()
    events, seen = [], []
    m.register_attention_observer(lambda mod, e: events.append(e))
    m.register_head_hook(lambda mod, out: seen.append(out.detach()))
    out, w = m(x, is_causal=True, return_weights=True)
    assert torch.equal(events[0].weights, w) and events[0].kind == "output_gated"
    assert_paths_agree(w.sum(-1), torch.ones(2, H, 7, dtype=F64))  # rows sum to 1: no gate in them
    q, k, v, extra = m.to_heads(x)
    ungated = torch.softmax(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * D**-0.5
                            + torch.full((7, 7), float("-inf"), dtype=F64).triu(1), -1) @ v.repeat_interleave(2, 1)  # fmt: skip
    assert_paths_agree(seen[0], ungated * torch.sigmoid(extra["gate"]))  # (B, H, T, 1) gates over D


def test_cost_adds_the_gate_rows_to_the_projection():
    B, T, S = 2, 5, 9
    for gate, E in (("headwise", 1), ("elementwise", D)):
        m = build(gate)
        gqa = MultiHeadAttention(C, H, num_kv_heads=2, head_dim=D, dtype=F64)
        got, base = m.cost(T, S, batch=B, causal=True), gqa.cost(T, S, batch=B, causal=True)
        assert got.core_flops == base.core_flops
        assert got.projection_flops - base.projection_flops == 2 * B * T * C * H * E
        assert got.parameters - base.parameters == H * E * (C + 1)
        assert got.kv_cache_bytes_per_token == base.kv_cache_bytes_per_token


@pytest.mark.parametrize(
    "options,error,match",
    [
        ({"gate": "channel"}, ValueError, r"gate must be one of \['headwise', 'elementwise'\], got gate='channel'"),
        ({"qk_norm_unit_offset": 1}, TypeError, "qk_norm_unit_offset must be a bool, got qk_norm_unit_offset=1"),
        ({"qk_norm_eps": -1.0}, ValueError, "eps must be a finite float >= 0, got eps=-1.0"),
        ({"kdim": 8}, TypeError, r"OutputGatedAttention does not take kdim \(got \{'kdim': 8\}\)"),
    ],
)
def test_bad_options_are_one_line_errors(options, error, match):
    with pytest.raises(error, match=match):
        build_attention("output_gated", embed_dim=C, num_heads=H, **options)


def test_trains_by_name_from_the_command_line_and_opens_in_the_head_explorer(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("to be or not to be that is the question\n" * 200)
    run = tmp_path / "run"
    rc, _, err = quietly("train", "--data", str(data), "--preset", "tiny", "--attention", "output_gated",
                         "--attention-option", "gate=headwise", "--batch-size", "4", "--eval-batches", "1",
                         "--warmup", "1", "--threads", "1", "--max-steps", "2", "--eval-every", "2",
                         "--checkpoint-every", "2", "--out", str(run))  # fmt: skip
    assert rc == 0, err
    model = load_checkpoint(run / "checkpoints" / "step-000002").eval()
    attn = model.blocks[0].attn
    assert isinstance(attn, OutputGatedAttention) and attn.gate == "headwise"
    found = inspect_text("To be", checkpoint=str(run))
    assert all(e.kind == "output_gated" for e in found.record.layers)
    assert all(torch.allclose(e.weights.sum(-1), torch.ones(())) for e in found.record.layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
@torch.no_grad()
def test_cuda_matches_cpu_and_bfloat16_kernels_stay_close(gate):
    """float64 on CUDA equals CPU. bfloat16 on CUDA (D = 16: SDPA's flash and memory-efficient
    kernels), full and cached: error against float64 at most 2x that of the plain math path in
    bfloat16 plus a noise floor (docs/testing.md), and the ungated layer is farther than that."""
    torch.manual_seed(0)
    m = build_attention("output_gated", embed_dim=64, num_heads=4, num_kv_heads=2, gate=gate, rope=True,
                        qk_norm=True, qk_norm_unit_offset=True, dtype=F64).eval()  # fmt: skip
    x = torch.randn(2, 33, 64, dtype=F64, generator=torch.Generator().manual_seed(1))
    want = m(x, is_causal=True)
    gpu = build_attention("output_gated", embed_dim=64, num_heads=4, num_kv_heads=2, gate=gate, rope=True,
                          qk_norm=True, qk_norm_unit_offset=True, dtype=F64, device="cuda").eval()  # fmt: skip
    gpu.load_state_dict(m.state_dict())
    torch.testing.assert_close(gpu(x.cuda(), is_causal=True).cpu(), want, rtol=0, atol=1e-12)
    half = gpu.to(torch.bfloat16)
    xb = x.to("cuda", torch.bfloat16)
    cache = half.make_kv_cache(2, 33)
    steps = torch.cat([half(xb[:, :20], is_causal=True, kv_cache=cache)]
                      + [half(xb[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(20, 33)], dim=1)  # fmt: skip

    def err(got):
        return float((got.double().cpu() - want).abs().max())

    scale = float(want.abs().max())
    plain, floor = err(half(xb, is_causal=True, backend="math")), 1e-3 * scale
    for got in (half(xb, is_causal=True), steps):
        assert err(got) <= 2 * plain + floor, (err(got), plain, floor)
    m.qkv_proj.bias[64 : 64 + 4 * m.gate_width] = 60.0  # negative control: the same layer with its gates open
    assert float((steps.double().cpu() - m(x, is_causal=True)).abs().max()) > 10 * (2 * plain + floor)
