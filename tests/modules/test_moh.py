"""MoHAttention: reference, sparse == dense, gradients, cache, cost, observer, errors, GPT."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.paths import assert_cached_generation_agrees, assert_paths_agree

from multihead.modules.kinds.moh import MoHAttention, load_balancing_loss
from multihead.modules.registry import build_attention
from multihead.reference.moh import moh_attention, moh_learned_gates, moh_load_balancing_loss

F64 = torch.float64


def make(seed=0, **kw):
    torch.manual_seed(seed)
    kw.setdefault("embed_dim", 20)
    kw.setdefault("num_heads", 4)
    m = MoHAttention(kw.pop("embed_dim"), kw.pop("num_heads"), dtype=F64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.5)
    return m.eval()


def weights(layer):
    return None if layer is None else layer.weight.detach().numpy()


def reference(m, x, mask=None, is_causal=False, return_weights=False):
    b = m.qkv_proj.bias
    res = moh_attention(
        x.detach().numpy(), weights(m.qkv_proj), None if b is None else b.detach().numpy(),
        weights(m.out_proj), m.out_proj.bias.detach().numpy(), m.num_heads, m.shared_heads, m.routed_heads,
        W_g=weights(m.routed_gate), W_g0=weights(m.mix_gate), W_g1=weights(m.shared_gate), router=m.router,
        num_kv_heads=m.num_kv_heads, mask=mask, is_causal=is_causal, return_weights=return_weights,
    )
    if return_weights:
        return tuple(torch.from_numpy(np.ascontiguousarray(r)) for r in res)
    return torch.from_numpy(res)


def close(a, b, tol=1e-10):
    torch.testing.assert_close(a, b, rtol=0, atol=tol * max(1.0, float(b.detach().abs().max())))


SETTINGS = [
    dict(embed_dim=35, num_heads=7, shared_heads=2, routed_heads=2),  # D = 5, E = 5
    dict(embed_dim=20, num_heads=4, shared_heads=0, routed_heads=2),
    # r = 2 query heads per key/value head: the shared block (head 0) and the
    # routed block (heads 1-3) each cut group 0 (catches: a wrong key/value
    # head index in moh_paths.kv_for's cut-group branch)
    dict(embed_dim=20, num_heads=4, shared_heads=1, routed_heads=2, num_kv_heads=2),
    dict(embed_dim=30, num_heads=6, shared_heads=3, routed_heads=1, num_kv_heads=2),  # whole groups: GQA kept
    dict(embed_dim=20, num_heads=4, shared_heads=1, routed_heads=1, head_dim=3),  # constant shared gate, H·D != C
    dict(embed_dim=20, num_heads=4, router="query_norm"),
]


@pytest.mark.parametrize("kw", SETTINGS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_with_padding(kw, causal):
    m = make(**kw)
    x = torch.randn(3, 7, m.embed_dim, dtype=F64)
    keep = torch.ones(3, 7, dtype=torch.bool)
    keep[1, 5:] = False
    keep[2, :2] = False
    want = reference(m, x, mask=keep[:, None, None, :].numpy(), is_causal=causal)
    for path in ("sparse", "dense"):
        close(m(x, key_mask=keep, is_causal=causal, path=path), want)


@pytest.mark.parametrize("kw", SETTINGS[:3])
def test_sparse_and_dense_gradients_agree(kw):
    m = make(**kw)
    x = torch.randn(2, 7, m.embed_dim, dtype=F64)
    grads = []
    for path in ("sparse", "dense"):
        m.zero_grad()
        xi = x.clone().requires_grad_(True)
        m(xi, is_causal=True, path=path).pow(2).sum().backward()
        grads.append([xi.grad] + [p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads):
        close(a, b)


def test_gradcheck():
    m = make(embed_dim=6, num_heads=3, shared_heads=1, routed_heads=1)
    x = torch.randn(1, 4, 6, dtype=F64, requires_grad=True)
    for path in ("sparse", "dense"):
        assert torch.autograd.gradcheck(lambda t, p=path: m(t, is_causal=True, path=p), (x,))
        assert torch.autograd.gradcheck(lambda t, p=path: m(t.transpose(0, 1), path=p), (x.transpose(0, 1),))


def test_masks_per_head_and_float():
    m = make(embed_dim=35, num_heads=7, shared_heads=2, routed_heads=2)
    x = torch.randn(2, 6, 35, dtype=F64)
    bool_mask = torch.rand(2, 7, 6, 6) > 0.3
    float_mask = torch.randn(1, 7, 6, 6, dtype=F64).masked_fill(torch.rand(1, 7, 6, 6) > 0.7, float("-inf"))
    for mask in (bool_mask, float_mask, bool_mask[0, 0]):
        want = reference(m, x, mask=mask.numpy())
        for path in ("sparse", "dense"):
            close(m(x, attn_mask=mask, path=path), want)


def test_fully_masked_rows_and_masked_nan_values():
    m = make(embed_dim=20, num_heads=4, shared_heads=1, routed_heads=2)
    x = torch.randn(2, 5, 20, dtype=F64)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[0] = False  # batch row 0 may attend to nothing
    for path in ("sparse", "dense"):
        out = m(x, key_mask=keep, path=path)
        assert torch.isfinite(out).all()
        close(out[0], m.out_proj.bias.detach().expand(5, 20))  # every head output 0
    # NaN at masked positions of key/value inputs (cross-attention) does not leak
    kv = torch.randn(2, 6, 20, dtype=F64)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[:, 4:] = False
    poisoned = kv.clone()
    poisoned[:, 4:] = float("nan")
    for path in ("sparse", "dense"):
        close(m(x, poisoned, key_mask=keep, path=path), m(x, kv, key_mask=keep, path="dense"))


def test_cross_attention_bottom_right():
    m = make(embed_dim=35, num_heads=7, shared_heads=2, routed_heads=2, num_kv_heads=7)
    x, kv = torch.randn(2, 4, 35, dtype=F64), torch.randn(2, 9, 35, dtype=F64)
    for align in ("top_left", "bottom_right"):
        a = m(x, kv, is_causal=True, causal_alignment=align, path="sparse")
        close(a, m(x, kv, is_causal=True, causal_alignment=align, path="dense"))


@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_cached_decoding_equals_full_recomputation(path):
    m = make(embed_dim=30, num_heads=6, shared_heads=2, routed_heads=2, num_kv_heads=3, path=path)
    x = torch.randn(2, 9, 30, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 9)
    steps = [m(x[:, :4], is_causal=True, kv_cache=cache)]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(4, 9)]
    close(torch.cat(steps, dim=1), full)
    with pytest.raises(ValueError, match="overflow"):
        m(x[:, :1], is_causal=True, kv_cache=cache)
    assert cache.length == 9


def _matmul_flops(fn):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize("kw", [SETTINGS[0], SETTINGS[2], SETTINGS[4]])
def test_cost_matches_counted_flops(kw):
    m = make(**kw)
    T = 9
    x = torch.randn(1, T, m.embed_dim, dtype=F64)
    dense = m.cost(T, active_heads=m.num_heads)
    sparse = m.cost(T)
    assert sparse.parameters == sum(p.numel() for p in m.parameters())
    assert dense.total_flops == _matmul_flops(lambda: m(x, backend="math", path="dense"))
    # the sparse path pads each routed head to M rows, the most any head received
    with torch.no_grad():
        _, chosen, _ = m.route(x, m.project(x)[0])
    if chosen is None:
        M = T * m.routed_heads // max(1, m.num_candidates)
    else:
        M = int(chosen.sum(1).max())
    run = 2 * (m.shared_heads * T + m.num_candidates * M) * T * 2 * m.head_dim
    assert sparse.projection_flops + run == _matmul_flops(lambda: m(x, backend="math", path="sparse"))
    assert run <= dense.core_flops
    assert sparse.core_flops * m.num_heads == dense.core_flops * m.active_heads
    assert m.cost(8, causal=True).core_flops * 64 == m.cost(8).core_flops * 36
    assert sparse.kv_cache_bytes_per_token == 2 * m.num_kv_heads * m.head_dim * 2


def test_observer_and_return_weights_are_the_gated_probabilities():
    m = make(embed_dim=35, num_heads=7, shared_heads=2, routed_heads=2)
    x = torch.randn(2, 6, 35, dtype=F64)
    want_out, want_w = reference(m, x, is_causal=True, return_weights=True)
    events = []
    handle = m.register_attention_observer(lambda mod, ev: events.append(ev))
    out = m(x, is_causal=True)
    handle.remove()
    close(out, want_out)
    (event,) = events
    assert event.kind == "moh" and event.weights.shape == (2, 7, 6, 6)
    close(event.weights, want_w)
    out2, w = m(x, is_causal=True, return_weights=True)
    close(w, want_w)
    # each token has hs + hr non-zero head rows; the values are mixed by exactly these weights
    q, k, v = m.project(x)
    mixed = (w @ v).transpose(1, 2).reshape(2, 6, -1)
    close(m.out_proj(mixed), out2)
    assert int((w.sum(-1) != 0).sum(1).max()) == m.active_heads


def test_aux_loss_in_training_only():
    m = make(embed_dim=35, num_heads=7, shared_heads=2, routed_heads=2, aux_loss_coeff=0.5)
    x = torch.randn(2, 6, 35, dtype=F64)
    m(x)
    assert m.last_balance_loss is None
    # eval mode: a 0-d zero of the module's dtype
    assert m.aux_loss().shape == () and m.aux_loss().dtype == F64 and float(m.aux_loss()) == 0
    m.train()
    m(x)
    _, p, sel = moh_learned_gates(
        x.numpy(), weights(m.routed_gate), weights(m.mix_gate), weights(m.shared_gate), 2, 2
    )
    want = moh_load_balancing_loss(p, sel)
    assert abs(float(m.last_balance_loss.detach()) - want) < 1e-12
    assert m.aux_loss().shape == () and abs(float(m.aux_loss().detach()) - 0.5 * want) < 1e-12
    model = torch.nn.ModuleList([m])
    close(load_balancing_loss(model), 0.5 * m.last_balance_loss.detach())
    load_balancing_loss(model).backward()
    assert m.routed_gate.weight.grad is not None and m.qkv_proj.weight.grad is None


def test_registry_and_defaults():
    m = build_attention("moh", embed_dim=48, num_heads=12)
    assert (m.shared_heads, m.routed_heads, m.active_heads, m.kind) == (6, 3, 9, "moh")
    assert build_attention("moh", embed_dim=8, num_heads=1).active_heads == 1
    y = m(torch.randn(2, 0, 48))
    assert y.shape == (2, 0, 48)


def test_construction_errors():
    with pytest.raises(ValueError, match="shared_heads=5 exceeds num_heads=4"):
        MoHAttention(20, 4, shared_heads=5)
    with pytest.raises(ValueError, match="routed_heads=3 exceeds the 2 routed candidates"):
        MoHAttention(20, 4, shared_heads=2, routed_heads=3)
    with pytest.raises(ValueError, match="routed_heads=0 needs shared_heads == num_heads=4"):
        MoHAttention(20, 4, shared_heads=2, routed_heads=0)
    with pytest.raises(ValueError, match="router must be one of"):
        MoHAttention(20, 4, router="norm")
    with pytest.raises(ValueError, match="path must be one of"):
        MoHAttention(20, 4, path="fast")
    with pytest.raises(ValueError, match="aux_loss_coeff"):
        MoHAttention(20, 4, aux_loss_coeff=float("nan"))
    with pytest.raises(ValueError, match="not divisible by num_heads=3"):
        MoHAttention(20, 3)
    with pytest.raises(TypeError, match="shared_heads"):
        MoHAttention(20, 4, shared_heads=1.5)


def test_call_errors():
    m = make()
    x = torch.randn(2, 5, 20, dtype=F64)
    with pytest.raises(ValueError, match="attn_mask has shape"):
        m(x, attn_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"attn_mask has shape \(2, 3, 5, 5\)"):  # 4-D, but 3 heads of 4
        m(x, attn_mask=torch.ones(2, 3, 5, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="bool"):
        m(x, attn_mask=torch.ones(5, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="key_mask must be"):
        m(x, key_mask=torch.ones(5, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="path must be one of"):
        m(x, path="fast")
    with pytest.raises(ValueError, match="query must be"):
        m(torch.randn(2, 5, 21, dtype=F64))


def test_gpt_generates_the_same_with_and_without_cache():
    from multihead.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", attention="moh", attention_options={"shared_heads": 1})).eval()
    idx = torch.randint(0, 256, (2, 5))
    assert_cached_generation_agrees(model, idx, 6)


def test_gpt_left_padded_batch_cached_equals_uncached():
    from multihead.models.gpt import GPT, GPTConfig

    torch.manual_seed(1)
    cfg = GPTConfig.from_preset("tiny", attention="moh", attention_options={"shared_heads": 0, "routed_heads": 2})
    model = GPT(cfg).eval()
    idx = torch.randint(0, 256, (2, 6))
    keep = torch.ones(2, 6, dtype=torch.long)
    keep[0, :3] = 0  # left padding
    assert_cached_generation_agrees(model, idx, 5, attention_mask=keep)


# ---------------------------------------------------------------- rope / qk_norm (beyond tests/modules/test_contract.py)
ROPED = dict(rope=True, qk_norm=True)


@pytest.mark.parametrize("path", ["sparse", "dense"])
def test_query_norm_router_routes_on_q_before_qk_norm_and_rope(path):
    """The query_norm router reads the projected q before qk_norm (which would
    flatten the head norms) and rope; both paths match that reference."""
    from support.kinds import numpy_forward

    m = make(embed_dim=24, num_heads=6, shared_heads=2, routed_heads=2, router="query_norm", head_dim=4,
             path=path, **ROPED)  # fmt: skip
    x = torch.randn(2, 5, 24, dtype=F64)
    want, _ = numpy_forward(m, x, is_causal=True)
    torch.testing.assert_close(m(x, is_causal=True), torch.from_numpy(want), rtol=0, atol=1e-10 * abs(want).max())
    cache = m.make_kv_cache(2, 5)
    steps = [m(x[:, :3], is_causal=True, kv_cache=cache)] + [m(x[:, t : t + 1], is_causal=True, kv_cache=cache)
                                                            for t in (3, 4)]  # fmt: skip
    assert_paths_agree(torch.cat(steps, 1), m(x, is_causal=True))


@pytest.mark.parametrize("router", ["learned", "query_norm"])
def test_sparse_equals_dense_with_rope_on_a_cut_group(router):
    """hs = 3 shared heads cut the second of G = 2 key/value groups."""
    m = make(embed_dim=30, num_heads=6, shared_heads=3, routed_heads=1, num_kv_heads=2, head_dim=4, router=router,
             **ROPED)  # fmt: skip
    x = torch.randn(2, 6, 30, dtype=F64, requires_grad=True)
    pos = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    a = m(x, is_causal=True, positions=pos, path="sparse")
    b = m(x, is_causal=True, positions=pos, path="dense")
    assert_paths_agree(a, b)
    (ga,), (gb,) = torch.autograd.grad(a.sum(), x), torch.autograd.grad(b.sum(), x)
    assert_paths_agree(ga, gb)


def test_defaults_are_the_papers_and_the_repr_names_grouped_heads():
    """catches: another load-balance coefficient (0.01) or default split (half shared, half the rest
    routed, at least one); a repr that hides num_kv_heads."""
    m = MoHAttention(16, 4)
    assert (m.aux_loss_coeff, m.shared_heads, m.routed_heads) == (0.01, 2, 1)
    assert MoHAttention(16, 4, shared_heads=4).routed_heads == 0  # every head shared: nothing to route
    assert "num_kv_heads" not in repr(m)
    assert "num_kv_heads=2" in repr(MoHAttention(16, 4, num_kv_heads=2))
