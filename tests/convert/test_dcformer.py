"""DCFormer's DCMHAttention weights -> multihead, against an independent
re-implementation of the official training forward written from the spec
(docs/variants/dcmha.md): merged weights dw_m/qkw_m, interleaved RoPE output,
term-by-term Compose with a loop over the two ranks, query chunks with the
key range [max(0, stop - c - w), stop), finfo.min mask fill."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from multihead.convert import from_official

F64 = torch.float64
DIM, N, T = 16, 4, 11
D, K, R = DIM // N, 4 * N, 2


def official_state(seed=0, qk_norm=True):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64) * 0.5  # noqa: E731
    sd = {
        "wqkv.weight": r(3 * DIM, DIM),
        "wo.weight": r(DIM, DIM),
        "dyn_w_proj.dw1": r(DIM, 1, 4, K),
        "dyn_w_proj.qkw": r(1, 4, K, 2 * R, N),
        "dyn_w_proj.dd": r(DIM, 1, 4 * N),
        "dyn_w_proj.pre_proj.w": torch.eye(N, dtype=F64)[None],
        "dyn_w_proj.post_proj.w": torch.eye(N, dtype=F64)[None],
    }
    sd["dyn_w_proj.dw_m"] = torch.cat([sd["dyn_w_proj.dw1"].reshape(DIM, 4 * K), sd["dyn_w_proj.dd"].reshape(DIM, 4 * N)], 1)
    sd["dyn_w_proj.qkw_m"] = sd["dyn_w_proj.qkw"].reshape(4, K, 2 * R * N)
    if qk_norm:
        sd["q_norm.scale"], sd["k_norm.scale"] = 1 + r(D), 1 + r(D)
    return sd


def freqs(T, base):
    j = torch.arange(D // 2, dtype=F64)
    ang = torch.arange(T, dtype=F64)[:, None] * base ** (-2 * j / D)
    return torch.stack([ang.cos(), ang.sin()], -1)  # (T, d/2, 2)


def rope_interleaved(x, fc):  # x (B, T, N, d): pair (j, j + d/2) written to (2j, 2j + 1)
    a, b = x[..., : D // 2], x[..., D // 2 :]
    cos, sin = fc[None, :, None, :, 0], fc[None, :, None, :, 1]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


def official_forward(sd, x, fc, mask, *, window, q_chunk_size, qk_norm=True):
    B, T, dim = x.shape
    q, k, v = (x @ sd["wqkv.weight"].T).split(dim, -1)
    q, k, v = (t.view(B, T, N, D) for t in (q, k, v))
    if qk_norm:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * sd["q_norm.scale"]
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * sd["k_norm.scale"]
    q, k = rope_interleaved(q, fc), rope_interleaved(k, fc)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, N, T, d)
    dw = x @ sd["dyn_w_proj.dw_m"]
    hidden = F.gelu(dw[..., : 4 * K].reshape(B, T, 4, K))
    gates = torch.tanh(dw[..., 4 * K :].reshape(B, T, 4, N))
    w = torch.einsum("btck,ckj->btcj", hidden, sd["dyn_w_proj.qkw_m"]).reshape(B, T, 4, 2 * R, N)
    w1, w2 = w[:, :, :, :R], w[:, :, :, R:]
    w1 = w1 / torch.sqrt(w1.pow(2).mean(-1, keepdim=True) + 1e-6)

    def cross_head(A, qs, ks, qsl, ksl):  # A (B, N, c, s); Compose of step 6, term by term
        out = A * (1 + gates[:, qsl, qs].transpose(1, 2)[..., None] + gates[:, ksl, ks].transpose(1, 2)[:, :, None])
        for i in range(R):
            hq = torch.einsum("bnts,btn->bts", A, w1[:, qsl, qs, i])
            out = out + torch.einsum("bts,btm->bmts", hq, w2[:, qsl, qs, i])
            hk = torch.einsum("bnts,bsn->bts", A, w1[:, ksl, ks, i])
            out = out + torch.einsum("bts,bsm->bmts", hk, w2[:, ksl, ks, i])
        return out

    c = q_chunk_size
    wlen = window if window is not None else dim
    outs = []
    for i in range(T // c + 1):
        start, stop = i * c, min((i + 1) * c, T)
        if start >= stop:
            continue
        kv0 = max(0, stop - c - wlen)
        qsl, ksl = slice(start, stop), slice(kv0, stop)
        L = (q[:, :, qsl] / math.sqrt(D)) @ k[:, :, ksl].transpose(-1, -2)
        L = cross_head(L, 0, 1, qsl, ksl)
        L = L.masked_fill(~mask[..., qsl, ksl], torch.finfo(F64).min)
        P = cross_head(torch.softmax(L, -1), 2, 3, qsl, ksl)
        outs.append(P @ v[:, :, ksl])
    o = torch.cat(outs, 2).transpose(1, 2).reshape(B, T, dim)
    return o @ sd["wo.weight"].T


def window_mask(T, W):  # make_window_mask(T, W): s <= t and t - s <= W
    t, s = torch.arange(T)[:, None], torch.arange(T)[None]
    return ((s <= t) & (t - s <= W))[None, None]


@pytest.mark.parametrize("lidx", [0, 1])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_matches_official_forward(lidx, qk_norm):
    sd = official_state(qk_norm=qk_norm)
    cfg = dict(dim=DIM, n_head=N, use_qk_norm=qk_norm, rope_base=10000.0, window_size=3, q_chunk_size=4)
    m = from_official("dcformer", sd, lidx=lidx, **cfg)
    x = torch.randn(2, T, DIM, dtype=F64)
    window = 3 if lidx == 0 else None
    mask = window_mask(T, 3) if window else torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    want = official_forward(sd, x, freqs(T, 10000.0), mask, window=window, q_chunk_size=4, qk_norm=qk_norm)
    with torch.no_grad():
        got_all = (m(x), m(x, freqs(T, 10000.0), mask))
    for got in got_all:
        assert float((got - want).abs().max()) <= 1e-10 * max(1.0, float(want.abs().max()))


def test_split_projections_and_stale_merged_weights():
    sd = official_state(qk_norm=False)
    want = from_official("dcformer", sd, dim=DIM, n_head=N, lidx=1)
    split = dict(sd)
    wq, wk, wv = split.pop("wqkv.weight").split(DIM)
    split.update({"wq.weight": wq, "wk.weight": wk, "wv.weight": wv})
    split["dyn_w_proj.dw1"] = torch.zeros_like(sd["dyn_w_proj.dw1"])  # stale original: dw_m wins
    got = from_official("dcformer", split, dim=DIM, n_head=N, lidx=1)
    x = torch.randn(1, 6, DIM, dtype=F64)
    assert torch.equal(got(x), want(x))  # one module class with equal weights: the same operations


def test_refuses_unsupported_settings():
    sd = official_state(qk_norm=False)
    with pytest.raises(ValueError, match="use_sw"):
        from_official("dcformer", sd, dim=DIM, n_head=N, use_sw=True)
    bad = dict(sd, **{"dyn_w_proj.pre_proj.w": 2 * torch.eye(N, dtype=F64)[None]})
    with pytest.raises(ValueError, match="identity"):
        from_official("dcformer", bad, dim=DIM, n_head=N)
    with pytest.raises(ValueError, match="n_local_heads"):
        from_official("dcformer", sd, dim=DIM, n_head=N, n_local_heads=2)
    with pytest.raises(ValueError, match="wo.weight"):
        from_official("dcformer", {k: v for k, v in sd.items() if k != "wo.weight"}, dim=DIM, n_head=N)
    with pytest.raises(ValueError, match="q_norm"):
        from_official("dcformer", sd, dim=DIM, n_head=N, use_qk_norm=True)
