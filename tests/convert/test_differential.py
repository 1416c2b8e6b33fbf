"""Differential Transformer V1 / V2 converters against re-implementations of the
official forwards (``MultiheadDiffAttn``, ``MultiheadFlashDiffV2``) written here
in plain torch: causal self-attention with interleaved rope, on the same random
weights, in full and decoded token by token through the KV cache."""

from __future__ import annotations

import math

import pytest
import torch
from support.paths import assert_paths_agree

from multihead.convert import from_official, official_kinds
from multihead.convert.official.diff_transformer import to_official

F64 = torch.float64
BASE = 10000.0


def _rope_interleaved(x: torch.Tensor, base: float) -> torch.Tensor:
    """x [B, T, n, d]: pairs (2i, 2i+1) rotated by t·base^(-2i/d), t = 0 .. T-1 (flash-attn's interleaved form)."""
    T, d = x.shape[1], x.shape[-1]
    ang = torch.arange(T, dtype=F64)[:, None] * base ** (-torch.arange(0, d, 2, dtype=F64) / d)  # (T, d/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]  # (T, 1, d/2)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = even * cos - odd * sin, even * sin + odd * cos
    return out


def _causal_softmax(scores: torch.Tensor) -> torch.Tensor:
    T, S = scores.shape[-2:]
    hidden = torch.triu(torch.full((T, S), float("-inf"), dtype=scores.dtype), 1 + S - T)
    return torch.softmax(scores + hidden, dim=-1)


def _repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, n, S, w] -> [B, n·n_rep, S, w], each head repeated n_rep times in place (the official helper)."""
    B, n, S, w = x.shape
    return x[:, :, None].expand(B, n, n_rep, S, w).reshape(B, n * n_rep, S, w)


def official_v1(sd, x, *, embed_dim, depth, num_heads, num_kv_heads=None):
    """``MultiheadDiffAttn.forward(x, rel_pos)`` (no attn_mask: causal), returns (out, signed weights)."""
    B, T, _ = x.shape
    H = num_heads
    G = H if num_kv_heads is None else num_kv_heads
    n_rep, d = H // G, embed_dim // H // 2
    q = (x @ sd["q_proj.weight"].T).view(B, T, 2 * H, d)
    k = (x @ sd["k_proj.weight"].T).view(B, T, 2 * G, d)
    v = (x @ sd["v_proj.weight"].T).view(B, T, G, 2 * d)
    q, k = _rope_interleaved(q, BASE), _rope_interleaved(k, BASE)
    q = q.transpose(1, 2) * d**-0.5
    k, v = _repeat_kv(k.transpose(1, 2), n_rep), _repeat_kv(v.transpose(1, 2), n_rep)
    w = _causal_softmax(q @ k.transpose(-1, -2))  # (B, 2H, T, T)
    lam_init = 0.8 - 0.6 * math.exp(-0.3 * depth)
    lam = (torch.exp((sd["lambda_q1"] * sd["lambda_k1"]).sum()) - torch.exp((sd["lambda_q2"] * sd["lambda_k2"]).sum())
           + lam_init)  # fmt: skip
    w = w.view(B, H, 2, T, T)
    w = w[:, :, 0] - lam * w[:, :, 1]
    o = w @ v  # (B, H, T, 2d)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * (1 - lam_init)
    return o.transpose(1, 2).reshape(B, T, 2 * H * d) @ sd["out_proj.weight"].T, w


def official_v2(sd, x, *, num_heads, num_kv_heads, head_dim):
    """``MultiheadFlashDiffV2.forward(x, rel_pos)`` with use_diff_v2=True; flash-attn's GQA reads
    key/value head j // (2H / G) for query head j."""
    B, T, _ = x.shape
    H, G, d = num_heads, num_kv_heads or num_heads, head_dim
    q = _rope_interleaved((x @ sd["q_proj.weight"].T).view(B, T, 2 * H, d), BASE).transpose(1, 2)
    k = _rope_interleaved((x @ sd["k_proj.weight"].T).view(B, T, G, d), BASE).transpose(1, 2)
    v = (x @ sd["v_proj.weight"].T).view(B, T, G, d).transpose(1, 2)
    r = 2 * H // G
    k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    w = _causal_softmax(q @ k.transpose(-1, -2) * d**-0.5)  # (B, 2H, T, T)
    o = (w @ v).transpose(1, 2)  # (B, T, 2H, d)
    lam = torch.sigmoid(x @ sd["lambda_proj.weight"].T)  # (B, T, H)
    o = o[:, :, 0::2] - lam[..., None] * o[:, :, 1::2]
    sig = lam.transpose(1, 2)[..., None]  # (B, H, T, 1)
    return o.reshape(B, T, H * d) @ sd["o_proj.weight"].T, w[:, 0::2] - sig * w[:, 1::2]


def _state(shapes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=F64) * 0.5 for n, s in shapes.items()}


def v1_state(C, H, G=None, seed=0):
    n_rep, d = H // (G or H), C // H // 2
    kv = (C // n_rep, C)
    shapes = {"q_proj.weight": (C, C), "k_proj.weight": kv, "v_proj.weight": kv, "out_proj.weight": (C, C)}
    shapes.update({f"lambda_{n}": (d,) for n in ("q1", "k1", "q2", "k2")})
    return _state(shapes, seed)


def v2_state(C, H, G, d, seed=0):
    G = G or H
    shapes = {"q_proj.weight": (2 * H * d, C), "k_proj.weight": (G * d, C), "v_proj.weight": (G * d, C),
              "o_proj.weight": (C, H * d), "lambda_proj.weight": (H, C)}  # fmt: skip
    return _state(shapes, seed)


def _decode(module, x, prefill=3):
    cache = module.make_kv_cache(x.shape[0], x.shape[1])
    steps = [module(x[:, :prefill], kv_cache=cache)]
    steps += [module(x[:, t : t + 1], kv_cache=cache) for t in range(prefill, x.shape[1])]
    return torch.cat(steps, dim=1)


def test_both_names_are_listed():
    assert {"diff_transformer", "diff_transformer_v2"} <= set(official_kinds())


@pytest.mark.parametrize("C,H,G,depth", [(16, 2, None, 0), (32, 4, 2, 3), (16, 4, 1, 1), (16, 2, 2, 5)])
def test_v1_equals_the_official_forward_and_decodes_token_by_token(C, H, G, depth):
    sd = v1_state(C, H, G)
    x = torch.randn(2, 7, C, dtype=F64, generator=torch.Generator().manual_seed(1))
    want, want_w = official_v1(sd, x, embed_dim=C, depth=depth, num_heads=H, num_kv_heads=G)
    module = from_official("diff_transformer", sd, embed_dim=C, depth=depth, num_heads=H, num_kv_heads=G)
    assert_paths_agree(module(x), want)
    _, w = module.attention(x, is_causal=True, return_weights=True)
    assert_paths_agree(w, want_w)  # the signed weights A1 - λ A2
    assert_paths_agree(_decode(module, x), want)
    assert to_official(module).keys() == sd.keys() and all(torch.equal(to_official(module)[n], sd[n]) for n in sd)
    assert module.attention.kind == "diff" and module.attention.lambda_init == 0.8 - 0.6 * math.exp(-0.3 * depth)


def test_v1_key_sharing_follows_repeat_kv_not_the_head_pairs():
    """H = 4, G = 2: both halves of head 0 read key sub-head 0 (repeat_kv); pairing head h with key
    sub-heads 2g, 2g+1 of its group is another function."""
    C, H, G = 16, 4, 2
    sd = v1_state(C, H, G)
    x = torch.randn(1, 5, C, dtype=F64, generator=torch.Generator().manual_seed(2))
    module = from_official("diff_transformer", sd, embed_dim=C, depth=0, num_heads=H, num_kv_heads=G)
    got = module(x)
    Wk, Wv = sd["k_proj.weight"].view(2 * G, -1, C), sd["v_proj.weight"].view(G, -1, C)  # key sub-heads, value heads
    values = Wv[[0, 0, 1, 1]].reshape(-1, C)  # head h reads value head h // 2
    as_mha = {**sd, "k_proj.weight": Wk[[0, 0, 1, 1, 2, 2, 3, 3]].reshape(-1, C), "v_proj.weight": values}  # j // 2
    paired = {**sd, "k_proj.weight": Wk[[0, 1, 0, 1, 2, 3, 2, 3]].reshape(-1, C), "v_proj.weight": values}
    repeated, _ = official_v1(as_mha, x, embed_dim=C, depth=0, num_heads=H, num_kv_heads=H)
    naive, _ = official_v1(paired, x, embed_dim=C, depth=0, num_heads=H, num_kv_heads=H)
    assert_paths_agree(got, repeated)
    assert float((got - naive).detach().abs().max()) > 1e-6


@pytest.mark.parametrize("C,H,G,d", [(16, 4, None, 4), (16, 4, 2, 4), (12, 3, 2, 4), (8, 2, 4, 6), (12, 3, 1, 2)])
def test_v2_equals_the_official_forward_and_decodes_token_by_token(C, H, G, d):
    """(12, 3, 2, 4): query heads 0 1 2 | 3 4 5 over kv 0 | 1: pair 1 = heads 2, 3 straddles both."""
    sd = v2_state(C, H, G, d)
    x = torch.randn(2, 7, C, dtype=F64, generator=torch.Generator().manual_seed(1))
    want, want_w = official_v2(sd, x, num_heads=H, num_kv_heads=G, head_dim=d)
    module = from_official("diff_transformer_v2", sd, d_model=C, num_heads=H, num_kv_heads=G, head_dim=d)
    assert_paths_agree(module(x), want)
    _, w = module.attention(x, is_causal=True, return_weights=True)
    assert_paths_agree(w, want_w)
    assert_paths_agree(_decode(module, x), want)
    assert module.attention.num_kv_heads == (G or H)
    assert to_official(module).keys() == sd.keys() and all(torch.equal(to_official(module)[n], sd[n]) for n in sd)


def test_v2_straddling_pair_reads_two_key_value_heads():
    """H = 3, G = 2: if pair 1 read one key/value head for both its heads, the output would differ."""
    C, H, G, d = 12, 3, 2, 4
    sd = v2_state(C, H, G, d)
    x = torch.randn(1, 5, C, dtype=F64, generator=torch.Generator().manual_seed(3))
    module = from_official("diff_transformer_v2", sd, d_model=C, num_heads=H, num_kv_heads=G, head_dim=d)
    one_kv = dict(sd, **{n: sd[n].view(G, d, C)[[0, 0]].reshape(-1, C) for n in ("k_proj.weight", "v_proj.weight")})
    other, _ = official_v2(one_kv, x, num_heads=H, num_kv_heads=G, head_dim=d)
    assert float((module(x) - other).detach().abs().max()) > 1e-6


def test_to_official_refuses_what_the_official_layer_cannot_hold():
    from multihead import build_attention

    with pytest.raises(ValueError, match=r"no biases or qk_norm; this one has \['k_proj.bias'"):
        to_official(build_attention("diff", embed_dim=16, num_heads=2))


def test_state_dict_errors_name_the_entries():
    sd = v1_state(16, 2)
    kw = {"embed_dim": 16, "depth": 0, "num_heads": 2}
    with pytest.raises(ValueError, match=r"state_dict lacks \['lambda_k2'\]"):
        from_official("diff_transformer", {n: t for n, t in sd.items() if n != "lambda_k2"}, **kw)
    with pytest.raises(ValueError, match=r"unexpected official keys \['subln.weight'\]"):
        from_official("diff_transformer", {**sd, "subln.weight": torch.ones(8)}, **kw)
    with pytest.raises(ValueError, match=r"'lambda_q1' has shape \(5,\), expected \(4,\)"):
        from_official("diff_transformer", {**sd, "lambda_q1": torch.zeros(5)}, **kw)
    with pytest.raises(ValueError, match="not divisible by 2 \\* num_heads=6"):
        from_official("diff_transformer", sd, embed_dim=16, depth=0, num_heads=3)
    sd2 = v2_state(12, 3, 2, 4)
    kw2 = {"d_model": 12, "num_heads": 3, "num_kv_heads": 2, "head_dim": 4}
    with pytest.raises(ValueError, match="use_diff_v2=False"):
        from_official("diff_transformer_v2", sd2, use_diff_v2=False, **kw2)
    with pytest.raises(ValueError, match="num_kv_heads=4 must divide 2 \\* num_heads=6"):
        from_official("diff_transformer_v2", sd2, **{**kw2, "num_kv_heads": 4})
    with pytest.raises(ValueError, match=r"'o_proj.weight' has shape \(12, 8\), expected \(12, 12\)"):
        from_official("diff_transformer_v2", {**sd2, "o_proj.weight": torch.zeros(12, 8)}, **kw2)
