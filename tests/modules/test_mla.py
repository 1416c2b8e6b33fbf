"""Multi-head latent attention: both decoding paths against the NumPy float64
reference, naive == absorbed at every decoding step, YaRN, cost, caches,
head selection, capture and the command line.

Tolerances (docs/testing.md): the module against the reference with
``assert_matches``; two paths (naive vs absorbed, cached vs full, selected vs
masked) with ``assert_paths_agree``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.attention import assert_matches
from support.mla import mla_forward
from support.paths import assert_cached_generation_agrees, assert_paths_agree
from torch.utils.flop_counter import FlopCounterMode

from multihead import build_attention
from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.kinds.mla import MultiHeadLatentAttention
from multihead.modules.kinds.mla_latent import yarn_frequencies, yarn_options
from multihead.modules.kv_cache import LatentKVCache
from multihead.reference.mla import yarn_theta
from multihead.tools.capture import capture
from multihead.tools.heads import mask_heads

F64 = torch.float64
C, H = 12, 3
SIZES = {"kv_lora_rank": 7, "qk_nope_head_dim": 5, "qk_rope_head_dim": 4, "v_head_dim": 3}
YARN = {"factor": 40.0, "original_seq_len": 8, "beta_fast": 32, "beta_slow": 1, "mscale": 0.7}


def make(seed=0, dtype=F64, **options) -> MultiHeadLatentAttention:
    torch.manual_seed(seed)
    m = build_attention("mla", embed_dim=C, num_heads=H, dtype=dtype, **{**SIZES, **options})
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m.eval()


def _x(B, T, seed=1, width=C, dtype=F64):
    return torch.randn(B, T, width, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _ref(m, x, kv=None, **kw):
    out, w = mla_forward(m, x.detach().numpy(), (x if kv is None else kv).detach().numpy(), **kw)
    return torch.from_numpy(np.ascontiguousarray(out)), torch.from_numpy(w)


CASES = {
    "plain": {},
    "q_lora": {"q_lora_rank": 5},
    "rope_norm": {"rope": True, "qk_norm": True},
    "norm_only": {"qk_norm": True},
    "q_lora_rope_half": {"q_lora_rank": 4, "rope": {"interleaved": False, "base": 50.0, "rotary_dim": 2}},
    "yarn": {"rope": True, "yarn": YARN, "q_lora_rank": 6},
    "yarn_rotate_half": {"rope": {"interleaved": False}, "yarn": YARN},
    "no_latent_norm": {"kv_norm": False, "rope": True},
    "no_rope_part": {"qk_rope_head_dim": 0},
    "converted_layout": {"kv_norm": False, "qk_rope_head_dim": 0},
}


@pytest.mark.parametrize("decode", ["naive", "absorbed"])
@pytest.mark.parametrize("case", list(CASES))
def test_module_matches_the_reference_outputs_weights_and_gradients(case, decode):
    m = make(decode=decode, **CASES[case])
    x = _x(2, 7).requires_grad_(True)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, 5:] = False
    out, w = m(x, is_causal=True, key_mask=keep, return_weights=True)
    want, want_w = _ref(m, x, mask=keep[:, None, None, :].numpy(), is_causal=True)
    assert_matches(out.detach(), want)
    assert_matches(w.detach(), want_w)
    # gradients: d(sum(out * g))/dx against central differences of the reference on a few entries
    g = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(5))
    (grad,) = torch.autograd.grad((out * g).sum(), x)
    for b, t, c in ((0, 3, 2), (1, 6, 11), (0, 0, 7)):
        e = torch.zeros_like(x)
        e[b, t, c] = 1e-5
        up, down = (_ref(m, (x + s * e).detach(), mask=keep[:, None, None, :].numpy(), is_causal=True)[0]
                    for s in (1, -1))  # fmt: skip
        numeric = float(((up - down) * g).sum() / 2e-5)
        assert math.isclose(float(grad[b, t, c]), numeric, rel_tol=1e-6, abs_tol=1e-7)


@pytest.mark.parametrize("decode", ["naive", "absorbed"])
def test_cross_attention_with_another_key_width(decode):
    m = make(decode=decode, kdim=5, rope=True, q_lora_rank=3)
    x, mem = _x(2, 4), _x(2, 6, seed=3, width=5)
    pos = torch.arange(4) + 2
    assert_matches(m(x, mem, positions=pos), _ref(m, x, mem, q_pos=pos.numpy())[0])
    assert_matches(m(x, mem, mem), _ref(m, x, mem)[0])
    with pytest.raises(ValueError, match="one latent of the key input"):
        m(x, mem, mem.clone())
    cache = m.make_kv_cache(2, 6)  # the value given as the key tensor, filling and then reusing a cache
    for _ in range(2):
        assert_matches(m(x, mem, mem, kv_cache=cache), _ref(m, x, mem)[0])


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("case", ["q_lora", "rope_norm", "yarn", "converted_layout"])
def test_naive_and_absorbed_agree_at_every_decoding_step(case, dtype):
    naive = make(decode="naive", dtype=dtype, **CASES[case])
    absorbed = make(decode="naive", dtype=dtype, **CASES[case])
    absorbed.decode = "absorbed"  # the same weights, switched path
    x = _x(2, 9, dtype=dtype)
    caches = naive.make_kv_cache(2, 9), absorbed.make_kv_cache(2, 9)
    assert type(caches[0]) is not LatentKVCache and type(caches[1]) is LatentKVCache
    full = naive(x, is_causal=True)
    steps = [(0, 3), *((t, t + 1) for t in range(3, 9))]  # a prefill, then one token at a time
    for t0, t1 in steps:
        a, b = (mod(x[:, t0:t1], is_causal=True, kv_cache=c) for mod, c in zip((naive, absorbed), caches))
        assert_paths_agree(b, a, msg=f"step {t0}:{t1}")
        assert_paths_agree(a, full[:, t0:t1], msg=f"step {t0}:{t1}")
    assert caches[0].length == caches[1].length == 9


@pytest.mark.parametrize("decode", ["naive", "absorbed"])
def test_yarn_with_per_row_positions_through_a_cache(decode):
    m = make(decode=decode, **CASES["yarn"])
    x = _x(2, 6)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])  # row 1 starts at position 7
    want = _ref(m, x, q_pos=pos.numpy(), k_pos=pos.numpy(), is_causal=True)[0]
    assert_matches(m(x, is_causal=True, positions=pos), want)
    cache = m.make_kv_cache(2, 6)
    parts = [m(x[:, :4], is_causal=True, positions=pos[:, :4], kv_cache=cache)]
    parts += [m(x[:, t : t + 1], is_causal=True, positions=pos[:, t : t + 1], kv_cache=cache) for t in (4, 5)]
    assert_matches(torch.cat(parts, dim=1), want)


def test_alibi_and_softcap_on_both_paths_through_a_cache_and_a_selection():
    slopes = [0.5, 0.25, 0.125]
    layers = {d: make(decode=d, alibi=slopes, softcap=3.0, rope=True) for d in ("naive", "absorbed")}
    x = _x(2, 6)
    full = layers["naive"](x, is_causal=True)
    assert_paths_agree(layers["absorbed"](x, is_causal=True), full)
    for m in layers.values():
        cache = m.make_kv_cache(2, 6)
        steps = [m(x[:, :3], is_causal=True, kv_cache=cache)] + [m(x[:, t : t + 1], is_causal=True, kv_cache=cache)
                                                                 for t in range(3, 6)]  # fmt: skip
        assert_paths_agree(torch.cat(steps, dim=1), full)
        small = m.select_heads([0, 2])  # slopes of one's own, one per kept head
        assert small.alibi_slopes.tolist() == [0.5, 0.125] and small.softcap == 3.0
        with mask_heads(m, {0: [1]}):
            assert_paths_agree(small(x, is_causal=True), m(x, is_causal=True))


def test_caches_hold_what_each_path_needs_and_cost_says_so():
    for decode, per_token in (("naive", H * (5 + 4 + 3)), ("absorbed", 7 + 4)):
        m = make(decode=decode, rope=True)
        cache = m.make_kv_cache(2, 10)
        elements = sum(b.numel() for b in cache.buffers()) // (2 * 10)
        assert elements == per_token
        for bpe in (2, 4):
            assert m.cost(5, bytes_per_element=bpe).kv_cache_bytes_per_token == per_token * bpe
    m = make()
    with pytest.raises(ValueError, match="decodes 'absorbed' but kv_cache is a KVCache"):
        m(_x(2, 3), kv_cache=make(decode="naive").make_kv_cache(2, 4))
    m.decode = "naive"
    with pytest.raises(ValueError, match="decodes 'naive' but kv_cache is a LatentKVCache"):
        m(_x(2, 3), kv_cache=make().make_kv_cache(2, 4))
    with pytest.raises(ValueError, match="decode must be one of"):
        m.decode = "absorb"


@pytest.mark.parametrize("decode", ["naive", "absorbed"])
@pytest.mark.parametrize("q_lora_rank", [0, 5])
def test_cost_matches_the_flop_counter_on_both_paths(decode, q_lora_rank):
    """Non-causal, math backend: the counted matrix products equal ``cost()``, self- and cross-attention."""
    x = _x(2, 3)
    for key in (None, _x(2, 4, seed=2, width=5)):
        m = make(decode=decode, q_lora_rank=q_lora_rank, kdim=None if key is None else 5)
        with FlopCounterMode(display=False) as counter:
            m(x, key, backend="math")
        assert counter.get_total_flops() == m.cost(3, None if key is None else 4, batch=2).total_flops


@pytest.mark.parametrize("decode", ["naive", "absorbed"])
@pytest.mark.parametrize("q_lora_rank", [0, 4])
def test_selected_heads_equal_the_others_masked(decode, q_lora_rank):
    m = make(decode="naive" if decode == "absorbed" else "absorbed", q_lora_rank=q_lora_rank, rope=True, qk_norm=True)
    m.decode = decode  # a path set after construction travels to the selection
    x = _x(2, 5)
    small = m.select_heads([0, 2])
    assert small.decode == decode and small.num_heads == 2 and small.kv_lora_rank == m.kv_lora_rank
    with mask_heads(m, {0: [1]}):
        want = m(x, is_causal=True)
    assert_paths_agree(small(x, is_causal=True), want)
    parts = [m.tensor_parallel_part(h) for h in ([0], [1, 2])]
    bias = m.out_proj.bias
    total = sum(p(x, is_causal=True) - bias for p in parts) + bias
    assert_paths_agree(total, m(x, is_causal=True))


def test_yarn_scale_frequencies_and_refusals():
    plain, yarn = make(rope=True), make(rope=True, yarn=YARN)
    mscale = 0.1 * 0.7 * math.log(40.0) + 1
    assert plain.scale == pytest.approx((5 + 4) ** -0.5) and yarn.scale == pytest.approx(plain.scale * mscale**2)
    x = _x(1, 6)
    assert float((yarn(x) - plain(x)).detach().abs().max()) > 1e-6  # the frequencies and the scale change the function
    with pytest.raises(ValueError, match="needs rope"):
        make(yarn=YARN)
    with pytest.raises(ValueError, match=r"missing \['original_seq_len'\]"):
        make(rope=True, yarn={"factor": 4.0})
    with pytest.raises(ValueError, match="factor must be > 1"):
        make(rope=True, yarn={"factor": 1.0, "original_seq_len": 8})
    with pytest.raises(ValueError, match="q_lora_rank must be an int >= 0"):
        make(q_lora_rank=-1)
    with pytest.raises(ValueError, match="qk_rope_head_dim=3 channels"):
        make(qk_rope_head_dim=3, rope=True)
    with pytest.raises(TypeError, match="does not take vdim"):
        make(vdim=4)


def test_defaults_cache_dtype_and_device_cost_defaults_and_repr():
    """Defaults are DeepSeek-V2's ratios at head width D: L = 4·D, R = D/2 (at least 2), no
    query bottleneck, Dn = Dv = D, the absorbed path."""
    for D in (4, 5, 16):
        m = build_attention("mla", embed_dim=3 * D, num_heads=3)
        assert (m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim) == (0, 4 * D, 2 * max(1, D // 4))
        assert (m.qk_nope_head_dim, m.v_head_dim, m.decode) == (D, D, "absorbed") and hasattr(m, "q_proj")
    m = make(rope=True)
    for decode in ("naive", "absorbed"):
        m.decode = decode
        assert m.make_kv_cache(2, 4).k.dtype == F64
        cache = m.make_kv_cache(2, 4, dtype=torch.float32, device="meta")
        assert cache.k.dtype == torch.float32 and cache.k.device.type == "meta"
        assert m.cost(5) == m.cost(5, 5, batch=1, causal=False, bytes_per_element=2)
        assert f"decode={decode!r}" in repr(m) and "yarn" not in repr(m)
    assert "yarn={'beta_fast': 32.0" in repr(make(rope=True, yarn=YARN))


def test_without_latent_norm_or_rope_part_the_layer_is_smaller_and_caches_only_the_latent():
    """kv_norm=False has no kv_a_norm; R = 0 gives scale 1/sqrt(Dn), no rope key and a
    latent cache of L channels; rope or qk_norm without rope channels are refused."""
    m = make(kv_norm=False, qk_rope_head_dim=0)
    assert m.kv_a_norm is None and not any(n.startswith("kv_a_norm") for n in m.state_dict())
    assert m.kv_a_proj.out_features == 7 and m.q_proj.out_features == H * 5 and m.scale == pytest.approx(5**-0.5)
    assert "kv_norm=False" in repr(m) and "kv_norm" not in repr(make())
    for decode, per_token in (("naive", H * (5 + 3)), ("absorbed", 7)):
        m.decode = decode
        cache = m.make_kv_cache(2, 4)
        assert sum(b.numel() for b in cache.buffers()) == 2 * 4 * per_token
        assert m.cost(4, bytes_per_element=4).kv_cache_bytes_per_token == 4 * per_token
    small = m.select_heads([1])
    assert small.kv_a_norm is None and small.qk_rope_head_dim == 0
    with pytest.raises(ValueError, match="qk_rope_head_dim=0 has none"):
        make(qk_rope_head_dim=0, rope=True)
    with pytest.raises(ValueError, match="qk_rope_head_dim=0 has none"):
        make(qk_rope_head_dim=0, qk_norm=True)
    with pytest.raises(TypeError, match="kv_norm must be a bool"):
        make(kv_norm="no")
    with pytest.raises(ValueError, match="qk_rope_head_dim must be a non-negative int"):
        make(qk_rope_head_dim=-1)


def test_rope_is_interleaved_unless_told():
    assert make(rope=True).rope["interleaved"] is True
    assert make(rope={"base": 100.0}).rope["interleaved"] is True
    assert make(rope={"interleaved": False}).rope["interleaved"] is False


@pytest.mark.parametrize("decode", ["naive", "absorbed"])
def test_gpt_capture_records_the_exact_weights_and_scores(decode):
    cfg = GPTConfig(vocab_size=24, context_length=12, embed_dim=C, num_layers=2, num_heads=H, attention="mla",
                    attention_options={**SIZES, "rope": True, "decode": decode})  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 24, (2, 6), generator=torch.Generator().manual_seed(1))
    with capture(model, scores=True) as record:
        model(idx)
    layer = record.layers[0]
    assert layer.kind == "mla" and layer.weights.shape == (2, H, 6, 6)
    assert_paths_agree(torch.softmax(layer.scores, dim=-1), layer.weights)  # scale · q·kᵀ of the event
    block = model.blocks[0]
    h = block.ln_1(model.token_embedding(idx) + model.position_embedding(torch.arange(6)))
    _, w = block.attn(h, is_causal=True, return_weights=True)
    assert torch.equal(layer.weights, w.detach())  # the same forward on the same input


def test_a_gpt_trained_on_the_naive_path_decodes_on_the_absorbed_one():
    cfg = GPTConfig(vocab_size=24, context_length=12, embed_dim=C, num_layers=2, num_heads=H, attention="mla",
                    attention_options={**SIZES, "rope": True, "q_lora_rank": 4, "decode": "naive"})  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg, dtype=F64)
    idx = torch.randint(0, 24, (2, 7), generator=torch.Generator().manual_seed(1))
    loss = torch.nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    model.eval()
    naive = model(idx)
    for block in model.blocks:
        block.attn.decode = "absorbed"
    assert_paths_agree(model(idx), naive)
    caches = model.make_kv_caches(2, 8)
    assert all(isinstance(c, LatentKVCache) for c in caches)
    assert_cached_generation_agrees(model, idx[:, :4], 3)


@pytest.fixture
def machine_limits(tmp_path, monkeypatch):
    """A cache holding this machine's entry, so ``roofline`` measures nothing."""
    import json

    from multihead.tools.machine_limits import device_name

    monkeypatch.setenv("MULTIHEAD_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    key = f"{device_name('cpu')} | {torch.get_num_threads()} threads | torch {torch.__version__}"
    entry = {"device": device_name("cpu"), "threads": torch.get_num_threads(), "torch": torch.__version__,
             "date": "2026-01-01", "peak_flops": {"float32": 100e9}, "bandwidth": 20e9}  # fmt: skip
    (tmp_path / "cache" / "machine-limits.json").write_text(json.dumps({key: entry}))


def test_roofline_command_reports_each_paths_cache(machine_limits, tmp_path, capsys):
    """``multihead roofline --attention mla`` on the tiny preset (C = 64, H = 4, D = 16: R = 8, Dn = Dv = 16)."""
    import argparse

    from multihead.commands import roofline

    parser = argparse.ArgumentParser()
    roofline.add_arguments(parser)
    for decode, per_layer in (("absorbed", 8 + 8), ("naive", 4 * (16 + 8 + 16))):
        args = parser.parse_args(["--preset", "tiny", "--attention", "mla", "--attention-option", "kv_lora_rank=8",
                                  "--attention-option", f"decode={decode}", "--context", "16", "--device", "cpu"])  # fmt: skip
        assert roofline.run(args) == 0
        assert f"KV cache: {per_layer * 4 * 2:,} bytes per token" in capsys.readouterr().out  # float32, 2 layers


@pytest.mark.parametrize("r,original_seq_len", [(8, 8), (8, 4096), (8, 2 * math.pi * 10000**1.4), (64, 4096)])
def test_yarn_frequencies_equal_the_references(r, original_seq_len):
    """(64, 4096) is DeepSeek-V3's rope width and original context: the ramp runs from
    channel 10 to 23 of 32, so the default beta_fast = 32 and beta_slow = 1 both matter."""
    yarn = yarn_options({"factor": 40.0, "original_seq_len": original_seq_len})
    got = yarn_frequencies(r, 10000.0, yarn).numpy()
    np.testing.assert_allclose(got, yarn_theta(r, 10000.0, 40.0, original_seq_len), rtol=1e-14)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_paths_agree_with_each_other_and_with_float64_at_every_step(dtype):
    """Prefill then one token at a time on the GPU, both paths, against the float64 CPU forward:
    relative Frobenius error within 1e-5 (float32) or 2e-2 (bfloat16), the two paths within the same."""
    ref = make(decode="naive", q_lora_rank=5, rope=True, qk_norm=True, yarn=YARN)
    x = _x(2, 9)
    want = ref(x, is_causal=True).detach()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    outs = {}
    for decode in ("naive", "absorbed"):
        m = make(decode=decode, q_lora_rank=5, rope=True, qk_norm=True, yarn=YARN).to("cuda", dtype)
        cache = m.make_kv_cache(2, 9)
        assert cache.k.device.type == "cuda" and cache.k.dtype == dtype
        with torch.no_grad():
            xs = x.to("cuda", dtype)
            steps = [m(xs[:, :3], is_causal=True, kv_cache=cache)]
            steps += [m(xs[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(3, 9)]
        outs[decode] = torch.cat(steps, dim=1).double().cpu()
        err = float((outs[decode] - want).norm() / want.norm())
        assert err < tol, (decode, dtype, err)
    err = float((outs["naive"] - outs["absorbed"]).norm() / want.norm())
    assert err < tol, (dtype, err)
