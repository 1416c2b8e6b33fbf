"""MoH's causal sparse path in blocks: gathered rows, maskless prefixes, diagonal blocks, merged by lse."""

from __future__ import annotations

import math

import pytest
import torch
from support.paths import assert_paths_agree

from multihead.modules.kinds import moh_causal, moh_paths
from multihead.modules.kinds.moh import MoHAttention
from multihead.modules.kinds.moh_causal import block_causal_rows, block_plan
from multihead.reference.moh import moh_attention

F64 = torch.float64


def explicit(rows, tok, k, v, offset):
    """softmax over keys j <= tok + offset, written out: [B, E, N, D]."""
    s = rows @ k.transpose(-1, -2) / math.sqrt(rows.shape[-1])
    hidden = torch.arange(k.shape[2]) > (tok + offset).unsqueeze(-1)
    return torch.softmax(s.masked_fill(hidden, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("diagonal", moh_causal.DIAGONALS)
@pytest.mark.parametrize(("T", "L", "offset"), [(37, 8, 0), (40, 10, 0), (23, 8, 5), (7, 16, 0)])
def test_block_rows_equal_an_explicit_mask_with_gradients(diagonal, T, L, offset):
    torch.manual_seed(T + L)
    B, E, D = 2, 3, 5
    q = torch.randn(B, E, T, D, dtype=F64, requires_grad=True)
    k, v = (torch.randn(B, E, T + offset, D, dtype=F64, requires_grad=True) for _ in range(2))
    chosen = torch.rand(B, T, E) < 0.4
    tok, valid, sizes = block_plan(chosen, L)
    rows = q.gather(2, tok.unsqueeze(-1).expand(*tok.shape, D))
    got = block_causal_rows(rows, q, k, v, tok, sizes, L, offset, diagonal=diagonal)
    want = explicit(rows, tok, k, v, offset)
    assert_paths_agree(got, want)
    g = torch.randn_like(got)
    grads = torch.autograd.grad((got * g).sum(), (q, k, v), retain_graph=True)
    for a, b in zip(grads, torch.autograd.grad((want * g).sum(), (q, k, v))):
        assert_paths_agree(a, b)


def test_block_plan_lists_every_chosen_row_once_in_its_block_in_order():
    torch.manual_seed(1)
    B, T, E, L = 2, 45, 4, 8
    chosen = torch.rand(B, T, E) < 0.3
    tok, valid, sizes = block_plan(chosen, L)
    assert len(sizes) == 6 and tok.shape == (B, E, sum(sizes)) and int(tok.max()) < T
    start = 0
    for c, n in enumerate(sizes):
        block = tok[:, :, start : start + n]
        assert bool(((block >= c * L) & (block < (c + 1) * L)).all())  # padding stays in its block
        for b in range(B):
            for e in range(E):
                picked = block[b, e][valid[b, e, start : start + n]].tolist()
                assert picked == [t for t in range(c * L, min(T, (c + 1) * L)) if chosen[b, t, e]]
                assert len(set(block[b, e].tolist())) == n  # distinct: scattering back is exact
        start += n


def make(seed=0, **kw):
    torch.manual_seed(seed)
    m = MoHAttention(kw.pop("embed_dim", 20), kw.pop("num_heads", 5), dtype=F64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m


def count_block_calls(monkeypatch):
    calls = []

    def spy(*args, **kw):
        calls.append(args[0].shape)
        return block_causal_rows(*args, **kw)

    monkeypatch.setattr(moh_paths, "block_causal_rows", spy)
    return calls


SETTINGS = [
    dict(shared_heads=1, routed_heads=2),  # E = 4
    dict(num_heads=4, shared_heads=1, routed_heads=1, num_kv_heads=2),  # a cut key/value group
    dict(num_heads=4, shared_heads=0, routed_heads=2, router="query_norm"),
]


@pytest.mark.parametrize("kw", SETTINGS)
def test_long_causal_sparse_matches_dense_and_gradients_reach_router_and_projections(kw, monkeypatch):
    calls = count_block_calls(monkeypatch)
    m = make(**kw).train()
    T = moh_causal.BLOCK * 3 + 17  # four blocks, the last one short (keys copied contiguous)
    x = torch.randn(2, T, m.embed_dim, dtype=F64)
    results = []
    for path in ("sparse", "dense"):
        xi = x.clone().requires_grad_(True)
        m.zero_grad()
        y = m(xi, is_causal=True, path=path)
        # mean, not sum: with routed_heads=1 the output's gradient to routed_gate is 0 up to rounding (p / p),
        # which a sum over 1570 rows would lift above the float64 tolerance of the aux loss's gradient
        (y.pow(2).mean() + m.aux_loss()).backward()
        results.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in m.named_parameters()}))
    assert len(calls) == 1  # the sparse call ran in blocks
    (ys, gs, ps), (yd, gd, pd) = results
    assert_paths_agree(ys, yd)
    assert_paths_agree(gs, gd)
    for name in pd:
        assert float(pd[name].abs().max()) > 0, name
        assert_paths_agree(ps[name], pd[name], msg=name)


def test_long_causal_sparse_matches_the_float64_reference(monkeypatch):
    calls = count_block_calls(monkeypatch)
    m = make(seed=2, shared_heads=2, routed_heads=1).eval()
    x = torch.randn(1, moh_causal.BLOCK + 40, m.embed_dim, dtype=F64)
    w = {n: p.detach().numpy() for n, p in m.named_parameters()}
    want = moh_attention(
        x.numpy(), w["qkv_proj.weight"], w["qkv_proj.bias"], w["out_proj.weight"], w["out_proj.bias"],
        m.num_heads, m.shared_heads, m.routed_heads, W_g=w["routed_gate.weight"], W_g0=w["mix_gate.weight"],
        W_g1=w["shared_gate.weight"], is_causal=True,
    )  # fmt: skip
    with torch.no_grad():
        got = m(x, is_causal=True)
    assert len(calls) == 1
    torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=1e-10 * max(1.0, abs(want).max()))


def test_bottom_right_cross_attention_in_blocks(monkeypatch):
    calls = count_block_calls(monkeypatch)
    m = make(seed=3, shared_heads=1, routed_heads=2).eval()
    T = moh_causal.BLOCK + 30
    x, kv = torch.randn(1, T, m.embed_dim, dtype=F64), torch.randn(1, T + 9, m.embed_dim, dtype=F64)
    with torch.no_grad():
        a = m(x, kv, is_causal=True, causal_alignment="bottom_right", path="sparse")
        b = m(x, kv, is_causal=True, causal_alignment="bottom_right", path="dense")
    assert len(calls) == 1
    assert_paths_agree(a, b)


def test_non_finite_keys_and_masks_take_the_explicit_path(monkeypatch):
    calls = count_block_calls(monkeypatch)
    m = make(seed=4, shared_heads=1, routed_heads=2).eval()
    T = moh_causal.BLOCK + 10
    x = torch.randn(1, T, m.embed_dim, dtype=F64)
    keep = torch.ones(1, T, dtype=torch.bool)
    keep[0, 3] = False
    with torch.no_grad():
        assert_paths_agree(m(x, key_mask=keep, is_causal=True), m(x, key_mask=keep, is_causal=True, path="dense"))
        x[0, T - 1] = float("nan")  # the last token: every earlier row's output stays finite
        a, b = m(x, is_causal=True), m(x, is_causal=True, path="dense")
    assert calls == []
    assert bool(torch.isfinite(a[0, : T - 1]).all())
    assert_paths_agree(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("diagonal", moh_causal.DIAGONALS)
def test_cuda_block_rows_match_cpu(diagonal):
    torch.manual_seed(5)
    B, E, T, D, L = 2, 3, 300, 64, 128
    q, k, v = (torch.randn(B, E, T, D) for _ in range(3))
    chosen = torch.rand(B, T, E) < 0.3
    tok, _, sizes = block_plan(chosen, L)
    outs, grads = [], []
    for dev in ("cpu", "cuda"):
        qd, kd, vd = (t.detach().to(dev).requires_grad_(True) for t in (q, k, v))  # leaves on each device
        td = tok.to(dev)
        rows = qd.gather(2, td.unsqueeze(-1).expand(*td.shape, D))
        o = block_causal_rows(rows, qd, kd, vd, td, sizes, L, 0, diagonal=diagonal)
        o.pow(2).sum().backward()
        outs.append(o.detach().cpu())
        grads.append([t.grad.cpu() for t in (qd, kd, vd)])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
