"""The official DeepSeek-V3 ``MLA`` layout against a re-implementation of the
official forward in plain torch (written from the official code's semantics:
(B, T, H, D) layout, rope as complex multiplication of adjacent pairs, YaRN
frequencies of ``precompute_freqs_cis``, caches written at ``start_pos``),
causal prefill and then decoding token by token, on both ``attn_impl`` paths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from support.paths import assert_paths_agree

from multihead import convert
from multihead.convert.official.deepseek_v3_mla import from_official, to_official

F64 = torch.float64
BASE = dict(dim=12, n_heads=3, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=5,
            rope_theta=10000.0, max_batch_size=2)  # fmt: skip
# original_seq_len 1024 puts the YaRN ramp's upper end at channel 2 > R/2 - 1 = 1 (the official clamp is R - 1)
YARN_ON = dict(max_seq_len=2048, original_seq_len=1024, rope_factor=4.0, beta_fast=32, beta_slow=1, mscale=0.8)
YARN_OFF = dict(max_seq_len=16, original_seq_len=16)


def official_freqs_cis(cfg) -> torch.Tensor:
    """Complex e^{i·t·θ_k} [max_seq_len, R/2], YaRN when max_seq_len > original_seq_len."""
    dim, base, seqlen = cfg["qk_rope_head_dim"], cfg["rope_theta"], cfg["max_seq_len"]
    freqs = 1.0 / base ** (torch.arange(0, dim, 2, dtype=F64) / dim)
    if seqlen > cfg["original_seq_len"]:
        def correction(rotations):
            return dim * math.log(cfg["original_seq_len"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction(cfg["beta_fast"])), 0)
        high = min(math.ceil(correction(cfg["beta_slow"])), dim - 1)
        if low == high:
            high += 0.001
        smooth = 1 - ((torch.arange(dim // 2, dtype=F64) - low) / (high - low)).clamp(0, 1)
        freqs = freqs / cfg["rope_factor"] * (1 - smooth) + freqs * smooth
    angles = torch.outer(torch.arange(seqlen, dtype=F64), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotary(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """x [B, T, h, R]: adjacent pairs as complex numbers times freqs_cis [T, R/2]."""
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3)


class OfficialForward:
    """The official MLA's forward with its caches (world_size 1, float64)."""

    def __init__(self, sd, cfg, attn_impl):
        self.sd, self.cfg, self.impl = sd, cfg, attn_impl
        self.freqs = official_freqs_cis(cfg)
        H, L, R = cfg["n_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        Dq, Dv, S = cfg["qk_nope_head_dim"] + R, cfg["v_head_dim"], cfg["max_seq_len"]
        B = cfg["max_batch_size"]
        self.scale = Dq**-0.5
        if cfg["max_seq_len"] > cfg["original_seq_len"]:
            self.scale *= (0.1 * cfg["mscale"] * math.log(cfg["rope_factor"]) + 1.0) ** 2
        self.k_cache, self.v_cache = torch.zeros(B, S, H, Dq, dtype=F64), torch.zeros(B, S, H, Dv, dtype=F64)
        self.kv_cache, self.pe_cache = torch.zeros(B, S, L, dtype=F64), torch.zeros(B, S, R, dtype=F64)

    def __call__(self, x, start_pos, mask):
        sd, cfg = self.sd, self.cfg
        H, L, R, Dn, Dv = (cfg[k] for k in ("n_heads", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                             "v_head_dim"))  # fmt: skip
        B, T, _ = x.shape
        end = start_pos + T
        freqs = self.freqs[start_pos:end]
        if cfg.get("q_lora_rank", 0) == 0:
            q = x @ sd["wq.weight"].T
        else:
            qa = x @ sd["wq_a.weight"].T
            q = F.rms_norm(qa, (qa.shape[-1],), sd["q_norm.weight"], 1e-6) @ sd["wq_b.weight"].T
        q = q.view(B, T, H, Dn + R)
        q_nope, q_pe = q[..., :Dn], rotary(q[..., Dn:], freqs)
        kv = x @ sd["wkv_a.weight"].T
        kv, k_pe = kv[..., :L], rotary(kv[..., L:].unsqueeze(2), freqs)
        kv = F.rms_norm(kv, (L,), sd["kv_norm.weight"], 1e-6)
        if self.impl == "naive":
            up = (kv @ sd["wkv_b.weight"].T).view(B, T, H, Dn + Dv)
            k = torch.cat([up[..., :Dn], k_pe.expand(-1, -1, H, -1)], dim=-1)
            self.k_cache[:B, start_pos:end], self.v_cache[:B, start_pos:end] = k, up[..., Dn:]
            q = torch.cat([q_nope, q_pe], dim=-1)
            scores = torch.einsum("bshd,bthd->bsht", q, self.k_cache[:B, :end]) * self.scale
        else:
            wkv_b = sd["wkv_b.weight"].view(H, -1, L)
            q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, :Dn])
            self.kv_cache[:B, start_pos:end], self.pe_cache[:B, start_pos:end] = kv, k_pe.squeeze(2)
            scores = (torch.einsum("bshc,btc->bsht", q_nope, self.kv_cache[:B, :end])
                      + torch.einsum("bshr,btr->bsht", q_pe, self.pe_cache[:B, :end])) * self.scale  # fmt: skip
        if mask is not None:
            scores = scores + mask.unsqueeze(1)
        scores = scores.softmax(dim=-1)
        if self.impl == "naive":
            out = torch.einsum("bsht,bthd->bshd", scores, self.v_cache[:B, :end])
        else:
            out = torch.einsum("bsht,btc->bshc", scores, self.kv_cache[:B, :end])
            out = torch.einsum("bshc,hdc->bshd", out, wkv_b[:, -Dv:])
        return out.flatten(2) @ sd["wo.weight"].T


def official_state(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    C, H, Rq, L = cfg["dim"], cfg["n_heads"], cfg.get("q_lora_rank", 0), cfg["kv_lora_rank"]
    Dn, R, Dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    shapes = {"wq.weight": (H * (Dn + R), C)} if not Rq else {
        "wq_a.weight": (Rq, C), "q_norm.weight": (Rq,), "wq_b.weight": (H * (Dn + R), Rq)}  # fmt: skip
    shapes |= {"wkv_a.weight": (L + R, C), "kv_norm.weight": (L,), "wkv_b.weight": (H * (Dn + Dv), L),
               "wo.weight": (C, H * Dv)}  # fmt: skip
    return {n: 0.5 * torch.randn(s, generator=g, dtype=F64) + (1.0 if "norm" in n else 0.0) for n, s in shapes.items()}


@pytest.mark.parametrize("attn_impl", ["absorb", "naive"])
@pytest.mark.parametrize("yarn", [YARN_ON, YARN_OFF], ids=["yarn", "no_yarn"])
@pytest.mark.parametrize("q_lora_rank", [0, 5])
def test_prefill_and_decoding_match_the_official_forward(q_lora_rank, yarn, attn_impl):
    cfg = {**BASE, **yarn, "q_lora_rank": q_lora_rank}
    sd = official_state(cfg)
    module = convert.from_official("deepseek_v3_mla", sd, **cfg, attn_impl=attn_impl,
                                   vocab_size=100, n_layers=1)  # model-wide fields are accepted  # fmt: skip
    assert module.attention.decode == {"absorb": "absorbed", "naive": "naive"}[attn_impl]
    official, other_path = OfficialForward(sd, cfg, attn_impl), OfficialForward(sd, cfg, "naive")
    x = torch.randn(2, 9, cfg["dim"], dtype=F64, generator=torch.Generator().manual_seed(1))
    T0 = 5
    mask = torch.full((T0, T0), float("-inf"), dtype=F64).triu_(1)
    got = module(x[:, :T0], 0, mask)
    assert_paths_agree(got, official(x[:, :T0], 0, mask))
    assert_paths_agree(got, other_path(x[:, :T0], 0, mask))  # the official naive path: the same function
    for t in range(T0, 9):  # decoding one token at a time, no mask
        got = module(x[:, t : t + 1], t)
        assert_paths_agree(got, official(x[:, t : t + 1], t, None), msg=f"step {t}")
        assert_paths_agree(got, other_path(x[:, t : t + 1], t, None), msg=f"step {t}")
    # a new sequence at start_pos 0 starts from an empty cache
    assert_paths_agree(module(x[:, :2], 0, mask[:2, :2]), OfficialForward(sd, cfg, attn_impl)(x[:, :2], 0, mask[:2, :2]))


def test_yarn_is_on_exactly_when_the_context_is_extended():
    on = from_official(official_state({**BASE, **YARN_ON}), **BASE, **YARN_ON).attention
    off = from_official(official_state({**BASE, **YARN_OFF}), **BASE, **YARN_OFF).attention
    assert off.yarn is None and off.scale == pytest.approx(8**-0.5)
    assert on.yarn["factor"] == 4.0 and on.scale == pytest.approx(8**-0.5 * (0.1 * 0.8 * math.log(4.0) + 1) ** 2)
    assert on.rope["interleaved"] and on.rope["base"] == 10000.0


def test_state_dict_round_trip_and_refusals():
    cfg = {**BASE, **YARN_OFF, "q_lora_rank": 5}
    sd = official_state(cfg)
    module = from_official(sd, **cfg)
    back = to_official(module)
    assert sorted(back) == sorted(sd) and all(torch.equal(back[n], sd[n]) for n in sd)
    assert "deepseek_v3_mla" in convert.official_kinds()
    with pytest.raises(ValueError, match=r"missing \['wq_b.weight'\]"):
        from_official({n: t for n, t in sd.items() if n != "wq_b.weight"}, **cfg)
    with pytest.raises(ValueError, match=r"wrong shape \{'wo.weight': \(12, 14\)\}"):
        from_official({**sd, "wo.weight": torch.zeros(12, 14, dtype=F64)}, **cfg)
    with pytest.raises(ValueError, match=r"unknown DeepSeek-V3 ModelArgs fields \['n_head'\]"):
        from_official(sd, **cfg, n_head=3)
    with pytest.raises(ValueError, match="world_size=2"):
        from_official(sd, **cfg, world_size=2)
    x = torch.randn(1, 3, 12, dtype=F64)
    module(x, 0)
    with pytest.raises(ValueError, match="start_pos=5 must be 0 .* or the cached length 3"):
        module(x[:, :1], 5)
    with pytest.raises(ValueError, match="batch 3 > max_batch_size=2"):
        module(torch.randn(3, 1, 12, dtype=F64), 0)
