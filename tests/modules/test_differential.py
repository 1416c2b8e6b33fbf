"""Differential attention V1 (``diff``) and V2 (``diff_v2``): the modules against the NumPy
reference (odd sizes, GQA, the straddling V2 pair, cross-attention), gradients against the
explicit form (weights combined first, then the values), the fused path against the explicit
one, cached decoding, the signed weights observers get, head selection and tensor-parallel
parts, cost and errors. The rest of the kind contract runs in tests/modules/test_contract*.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.attention import assert_matches, grads
from support.kinds import numpy_forward
from support.paths import assert_cached_generation_agrees, assert_paths_agree

from multihead import build_attention
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import prune_heads
from multihead.tools.heads import mask_heads

F64 = torch.float64


def make(kind, C, H, G=None, d=None, seed=0, **kw):
    torch.manual_seed(seed)
    m = build_attention(kind, embed_dim=C, num_heads=H, num_kv_heads=G, head_dim=d, dtype=F64, **kw)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.uniform_(0.5, 1.5) if name.startswith("qk_norm.") else p.normal_(0.0, 0.5)
    return m.eval()


def x_(B=2, T=7, C=15, seed=1):
    return torch.randn(B, T, C, dtype=F64, generator=torch.Generator().manual_seed(seed))


def explicit_forward(m, x, *, is_causal=False, keep=None):
    """The paper's form in torch, one head at a time: the two softmax maps combined into the
    signed weights first, then times the values (the fused path multiplies each map by the
    values and subtracts). Self-attention, no rope or qk_norm."""
    Hh, G, d = m.num_heads, m.num_kv_heads, m.head_dim
    B, T, _ = x.shape
    v1 = m.kind == "diff"
    q = m.q_proj(x).view(B, T, 2 * Hh, d).transpose(1, 2)
    k = m.k_proj(x).view(B, T, 2 * G if v1 else G, d).transpose(1, 2)
    v = m.v_proj(x).view(B, T, G, 2 * d if v1 else d).transpose(1, 2)
    hidden = torch.zeros(B, 1, T, T, dtype=torch.bool)
    if is_causal:
        hidden = hidden | ~torch.ones(T, T, dtype=torch.bool).tril()
    if keep is not None:
        hidden = hidden | ~keep[:, None, None, :]

    def softmax_map(j, kv):
        return torch.softmax((q[:, j] @ k[:, kv].transpose(-1, -2) * d**-0.5).masked_fill(hidden[:, 0], -math.inf), -1)

    heads = []
    for h in range(Hh):
        if v1:
            n_rep = Hh // G
            lam = (torch.exp((m.lambda_q1 * m.lambda_k1).sum()) - torch.exp((m.lambda_q2 * m.lambda_k2).sum())
                   + m.lambda_init)  # fmt: skip
            w = softmax_map(2 * h, 2 * h // n_rep) - lam * softmax_map(2 * h + 1, (2 * h + 1) // n_rep)
            o = w @ v[:, h // n_rep]
            heads.append(o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 - m.lambda_init))
        else:
            r = 2 * Hh // G
            s = torch.sigmoid(x @ m.lambda_proj.weight[h])[..., None]  # (B, T, 1)
            heads.append(softmax_map(2 * h, 2 * h // r) @ v[:, 2 * h // r]
                         - s * (softmax_map(2 * h + 1, (2 * h + 1) // r) @ v[:, (2 * h + 1) // r]))  # fmt: skip
    return m.out_proj(torch.cat(heads, dim=-1))


SIZES = {  # (kind, C, H, G, d): odd widths, GQA, V2 pairs over 2H / G query heads per key/value head
    "v1 mha": ("diff", 15, 3, None, 5),
    "v1 gqa": ("diff", 15, 4, 2, 5),
    "v1 mqa": ("diff", 15, 3, 1, 5),
    "v2 straddling": ("diff_v2", 15, 3, 2, 5),  # query heads 0 1 2 | 3 4 5 over kv 0 | 1: pair 1 reads both
    "v2 gqa": ("diff_v2", 15, 4, 2, 5),
    "v2 more kv than pairs": ("diff_v2", 15, 3, 6, 5),  # each query head its own key/value head
    "v2 mqa": ("diff_v2", 15, 2, 1, 5),
}


# ---------------------------------------------------------------- reference
@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("size", list(SIZES))
def test_matches_reference_outputs_and_weights(size, causal, backend):
    kind, C, H, G, d = SIZES[size]
    m, x = make(kind, C, H, G, d), x_(C=C)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, 5:] = False
    want, want_w = numpy_forward(m, x, mask=keep[:, None, None, :].numpy(), is_causal=causal)
    assert_matches(m(x, key_mask=keep, is_causal=causal, backend=backend), torch.from_numpy(want))
    out, w = m(x, key_mask=keep, is_causal=causal, return_weights=True)
    assert_matches(out, torch.from_numpy(want))
    assert_matches(w, torch.from_numpy(want_w))


@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
def test_cross_attention_with_another_key_width_matches_reference(kind):
    m = make(kind, 15, 4, 2, 5, kdim=6, vdim=6, rope={"interleaved": True, "rotary_dim": 4}, qk_norm=True)
    x, mem = x_(C=15), x_(T=4, C=6, seed=2)
    want = torch.from_numpy(numpy_forward(m, x, mem)[0])
    assert_matches(m(x, mem), want)
    cache = m.make_kv_cache(2, 4)
    first = m(x[:, :3], mem, kv_cache=cache)  # fills the cache with mem's keys and values
    later = m(x[:, 3:], mem, kv_cache=cache, positions=torch.arange(3, 7))  # reads them back
    assert_matches(torch.cat([first, later], dim=1), want)


@pytest.mark.parametrize("size", ["v1 gqa", "v2 straddling", "v2 more kv than pairs"])
def test_gradients_of_the_fused_path_equal_the_explicit_form(size):
    kind, C, H, G, d = SIZES[size]
    m = make(kind, C, H, G, d)
    x = x_(C=C).requires_grad_()
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[0, 4:] = False  # right padding: every row keeps a visible key
    params = [p for _, p in m.named_parameters()]
    want_out = explicit_forward(m, x, is_causal=True, keep=keep)
    want = grads(want_out, x, *params)
    for backend in ("sdpa", "math"):
        out = m(x, key_mask=keep, is_causal=True, backend=backend)
        assert_matches(out, want_out.detach())
        for g, w in zip(grads(out, x, *params), want):
            assert_matches(g, w)


@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
def test_input_gradient_matches_finite_differences_of_the_numpy_reference(kind):
    m, x = make(kind, 15, 4, 2, 5), x_(B=1, T=4)
    dx = torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    g = torch.randn(1, 4, 15, dtype=F64, generator=torch.Generator().manual_seed(6))
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad((m(xr, is_causal=True) * g).sum(), xr)
    h = 1e-5
    ref = [numpy_forward(m, x + s * h * dx, is_causal=True)[0] for s in (1, -1)]
    fd = float((torch.from_numpy(ref[0] - ref[1]) * g).sum()) / (2 * h)
    assert abs(float((gx * dx).sum()) - fd) < 1e-7 * max(1.0, abs(fd))


# ---------------------------------------------------------------- cache
@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("size", ["v1 gqa", "v1 mqa", "v2 straddling", "v2 more kv than pairs"])
def test_cached_decoding_equals_the_full_forward(size, step):
    kind, C, H, G, d = SIZES[size]
    m = make(kind, 16, H, G, 4, rope={"interleaved": True}, qk_norm=True)
    x = x_(T=8, C=16)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 8)
    parts = [m(x[:, :2], is_causal=True, kv_cache=cache)]
    parts += [m(x[:, t : t + step], is_causal=True, kv_cache=cache) for t in range(2, 8, step)]
    assert_paths_agree(torch.cat(parts, dim=1), full)
    G = G or H
    per_token = 4 * G * 4 if kind == "diff" else 2 * G * 4  # elements: V1 2G key sub-heads + G values of 2d
    assert (cache.k[0, :, 0].numel() + cache.v[0, :, 0].numel()) == per_token
    assert m.cost(8, bytes_per_element=2).kv_cache_bytes_per_token == 2 * per_token


# ---------------------------------------------------------------- signed weights and observers
@pytest.mark.parametrize("size", ["v1 gqa", "v2 straddling"])
def test_observers_get_the_signed_weights_and_the_sub_heads(size):
    kind, C, H, G, d = SIZES[size]
    m, x = make(kind, C, H, G, d), x_(C=C)
    events = []
    handle = m.register_attention_observer(lambda module, event: events.append(event))
    allow = torch.rand(2, H, 7, 7, generator=torch.Generator().manual_seed(4)) > 0.3
    allow |= torch.eye(7, dtype=torch.bool)
    m(x, attn_mask=allow)
    handle.remove()
    (e,) = events
    assert e.q.shape == (2, 2 * H, 7, d) and e.weights.shape == (2, H, 7, 7)
    assert e.attn_mask.shape == (2, 2 * H, 7, 7)  # the per-head mask as the core used it
    k = e.k.repeat_interleave(2 * H // e.k.shape[1], dim=1)  # capture's rule: query head j reads j // (2H / G')
    maps = torch.softmax((e.q @ k.transpose(-1, -2) * e.scale).masked_fill(~e.attn_mask, -math.inf), -1)
    if kind == "diff":
        factor = m.lambda_full().detach()
        assert_paths_agree(e.weights.sum(-1), (1 - factor).expand(2, H, 7))  # rows sum to 1 - λ
    else:
        factor = torch.sigmoid(m.lambda_proj(x)).detach().transpose(1, 2)[..., None]  # (B, H, T, 1)
        assert_paths_agree(e.weights.sum(-1), 1 - factor[..., 0])
    assert_paths_agree(e.weights, maps[:, 0::2] - factor * maps[:, 1::2])


# ---------------------------------------------------------------- heads
def test_v1_selection_keeps_whole_groups_and_refuses_part_of_one():
    m = make("diff", 16, 4, 2, 2, rope=True)  # heads 0 1 | 2 3 over key/value heads 0 | 1
    x = x_(C=16)
    small = m.select_heads([2, 3])
    with mask_heads(m, {0: [0, 1]}):
        want = m(x, is_causal=True)
    assert_paths_agree(small(x, is_causal=True), want)
    assert small.lambda_init == m.lambda_init and small.num_kv_heads == 1
    with pytest.raises(ValueError, match=r"2 heads per key/value head keeps whole groups .* heads=\[0, 2\]"):
        m.select_heads([0, 2])


def test_v2_selection_keeps_what_each_query_head_reads():
    """Query head j reads key/value head j // (2H / G); a selection is taken when the smaller layer's rule
    gives every kept query head the same key/value head, whole pairs straddling two of them included."""
    m = make("diff_v2", 16, 4, 2, 4)
    x = x_(C=16)
    for heads in ([0, 2], [1], [2, 3]):
        with mask_heads(m, {0: [h for h in range(4) if h not in heads]}):
            want = m(x, is_causal=True)
        assert_paths_agree(m.select_heads(heads)(x, is_causal=True), want)
    straddling = make("diff_v2", 15, 3, 2, 5)  # query heads 0 1 2 | 3 4 5 over kv 0 | 1
    for heads, G in (([0], 1), ([1], 2), ([2], 1), ([0, 1, 2], 2)):  # pair 1 = query heads 2, 3 reads kv 0 and 1
        small = straddling.select_heads(heads)
        assert small.num_kv_heads == G
        with mask_heads(straddling, {0: [h for h in range(3) if h not in heads]}):
            want = straddling(x_(C=15), is_causal=True)
        assert_paths_agree(small(x_(C=15), is_causal=True), want)
    with pytest.raises(ValueError, match=r"heads=\[0, 1\] .* query heads \[0, 1, 2, 3\] read key/value heads \[0, 0, 0, 1\]"):
        straddling.select_heads([0, 1])
    with pytest.raises(ValueError, match=r"kv_heads=\[1\] must be the key/value heads that heads=\[0\] read: \[0\]"):
        straddling.select_heads([0], kv_heads=[1])


@pytest.mark.parametrize("kind,G", [("diff", 2), ("diff_v2", 2), ("diff_v2", 8)])
def test_tensor_parallel_parts_sum_to_the_layer(kind, G):
    m = make(kind, 16, 4, G, 2, out_bias=False)
    x = x_(C=16)
    parts = [m.tensor_parallel_part(heads) for heads in ([0, 1], [2, 3])]
    assert_paths_agree(parts[0](x, is_causal=True) + parts[1](x, is_causal=True), m(x, is_causal=True))


# ---------------------------------------------------------------- models, options, errors
@pytest.mark.parametrize("kind,opts", [("diff", {"depth": 1}), ("diff_v2", {})])
def test_gpt_by_name_with_key_value_groups_generates_the_same_with_and_without_cache(kind, opts):
    cfg = GPTConfig(vocab_size=32, context_length=16, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2,
                    attention=kind, attention_options={**opts, "rope": {"interleaved": True}})  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(4))
    assert model.blocks[0].attn.kind == kind and model.blocks[0].attn.num_kv_heads == 2
    assert_cached_generation_agrees(model, idx, 4)


def test_a_gpts_diff_layers_take_their_depth_from_their_index_unless_the_options_set_it():
    """catches: every layer of a GPT built with the first layer's λ_init."""
    cfg = dict(vocab_size=32, context_length=16, embed_dim=16, num_layers=3, num_heads=2, attention="diff")
    by_index = [b.attn.lambda_init for b in GPT(GPTConfig(**cfg)).blocks]
    assert by_index == [0.8 - 0.6 * math.exp(-0.3 * i) for i in range(3)]
    fixed = [b.attn.lambda_init for b in GPT(GPTConfig(**cfg, attention_options={"depth": 5})).blocks]
    assert fixed == [0.8 - 0.6 * math.exp(-1.5)] * 3


@pytest.mark.parametrize("kind,opts", [("diff", {"head_dim": 2}), ("diff_v2", {})])
def test_pruned_gpt_equals_the_masked_one_and_reloads(kind, opts):
    cfg = GPTConfig(vocab_size=32, context_length=16, embed_dim=16, num_layers=2, num_heads=4, attention=kind,
                    attention_options=opts)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(4))
    with mask_heads(model, {0: [1]}):
        want = model(idx)
    prune_heads(model, {0: [1]})
    assert model.config.layer_heads == [3, 4]
    assert_paths_agree(model(idx), want)
    again = GPT(model.config).eval()
    again.load_state_dict(model.state_dict())
    assert_paths_agree(again(idx), want)


def test_pruning_a_gpt_of_diff_heads_without_head_dim_is_refused_with_the_reason():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, context_length=16, embed_dim=16, num_layers=1, num_heads=4, attention="diff"))
    with pytest.raises(ValueError, match="layer 0: its pruned DifferentialAttention .* attention_options"):
        prune_heads(model, {0: [1]})


def test_lambda_init_follows_depth_and_lambda_its_formula():
    for depth in (0, 1, 5, 23):
        m = build_attention("diff", embed_dim=16, num_heads=2, depth=depth, dtype=F64)
        assert m.lambda_init == pytest.approx(0.8 - 0.6 * np.exp(-0.3 * depth), abs=1e-15)
        p = [t.detach().numpy() for t in (m.lambda_q1, m.lambda_k1, m.lambda_q2, m.lambda_k2)]
        want = np.exp(p[0] @ p[1]) - np.exp(p[2] @ p[3]) + m.lambda_init
        assert float(m.lambda_full().detach()) == pytest.approx(want, abs=1e-14)
    assert build_attention("diff", embed_dim=16, num_heads=2).head_dim == 4  # C / (2H), the official width


@pytest.mark.parametrize(
    "kind,kw,match",
    [
        ("diff", {"embed_dim": 15, "num_heads": 2}, r"embed_dim=15 is not divisible by 2 \* num_heads=4"),
        ("diff", {"embed_dim": 16, "num_heads": 2, "depth": -1}, "depth must be an int >= 0"),
        ("diff", {"embed_dim": 16, "num_heads": 2, "depth": 1.5}, "got depth=1.5"),
        ("diff", {"embed_dim": 16, "num_heads": 4, "num_kv_heads": 3}, "num_kv_heads=3 must divide num_heads=4"),
        ("diff_v2", {"embed_dim": 12, "num_heads": 3, "num_kv_heads": 4}, r"must divide 2 \* num_heads=6"),
        ("diff_v2", {"embed_dim": 12, "num_heads": 3, "num_kv_heads": 0}, "num_kv_heads"),
    ],
)
def test_construction_errors_name_the_values(kind, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build_attention(kind, **kw)


@pytest.mark.parametrize("kind", ["diff", "diff_v2"])
def test_a_per_head_mask_of_another_head_count_is_refused(kind):
    m = make(kind, 16, 4, None, 2)
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, H=4, T, S\)"):
        m(x_(C=16), attn_mask=torch.ones(2, 3, 7, 7, dtype=torch.bool))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("size", ["v1 gqa", "v2 straddling"])
def test_cuda_matches_cpu(size):
    kind, C, H, G, d = SIZES[size]
    m, x = make(kind, 16, H, G, 4, rope={"interleaved": True}), x_(C=16)
    want = m(x, is_causal=True)
    m = m.cuda()
    got = m(x.cuda(), is_causal=True)
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=1e-12)
    cache = m.make_kv_cache(2, 7)
    steps = [m(x[:, :3].cuda(), is_causal=True, kv_cache=cache)]
    steps += [m(x[:, t : t + 1].cuda(), is_causal=True, kv_cache=cache) for t in range(3, 7)]
    torch.testing.assert_close(torch.cat(steps, dim=1).cpu(), want, rtol=0, atol=1e-12)
    m32, x32 = m.float(), x.float().cuda()
    torch.testing.assert_close(m32(x32, is_causal=True, backend="sdpa"), m32(x32, is_causal=True, backend="math"))


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,H,G", [("diff", 4, 2), ("diff_v2", 3, 2), ("diff_v2", 4, 8)])
def test_bfloat16_fused_path_and_cache_agree_with_the_weights_path(kind, H, G, device):
    """bfloat16 on each device: the fused path, the path that computes the weights and token-by-token
    decoding agree to bfloat16 rounding (3% of the output's largest magnitude)."""
    torch.manual_seed(0)
    m = build_attention(kind, embed_dim=64, num_heads=H, num_kv_heads=G, head_dim=8, rope={"interleaved": True})
    m = m.to(device, torch.bfloat16).eval()
    x = torch.randn(2, 48, 64, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    with torch.no_grad():
        fused = m(x, is_causal=True, backend="sdpa")
        explicit, w = m(x, is_causal=True, return_weights=True)
        cache = m.make_kv_cache(2, 48)
        steps = [m(x[:, :16], is_causal=True, kv_cache=cache)]
        steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(16, 48)]
    tol = {"rtol": 0.0, "atol": 0.03 * float(explicit.abs().max())}
    assert w.shape == (2, H, 48, 48) and fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused, explicit, **tol)
    torch.testing.assert_close(torch.cat(steps, dim=1), explicit, **tol)

