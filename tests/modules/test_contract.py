"""The contract every attention kind keeps, checked for every registered kind.

Kinds come from ``list_attention_kinds()`` at import, their options from the
one table in ``tests/support/kinds.py`` (a kind without a row fails here).
For each kind: the NumPy float64 reference with and without rope/qk_norm,
cached == full decoding, padding, bool and float masks, rope positions,
options off == default bitwise, observers, ``cost()`` against torch's FLOP
counter, state dicts, ``aux_loss`` through a GPT, cross-attention through a
cache, the ``kind`` attribute, and ``torch.compile(fullgraph=True)``.

Tolerances (docs/testing.md): a module against the reference within 1e-10
scaled by the output magnitude (``assert_matches``); two paths of the module
(cached vs full, padded vs not) within ``assert_paths_agree``; ``torch.equal``
only where the same operations run on the same shapes (said at each use).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from support.attention import assert_matches as _assert_matches
from support.compile import explain_and_run
from support.kinds import (
    COST_FORWARD,
    COST_OPTIONS,
    F64,
    LOSS_KINDS,
    OPTIONS,
    POSITIONAL,
    SOFTMAX_KINDS,
    C,
    H,
    build,
    numpy_forward,
    options,
    uncounted_flops,
)
from support.paths import assert_cached_generation_agrees, assert_paths_agree
from torch.utils.flop_counter import FlopCounterMode

from multihead import build_attention, list_attention_kinds
from multihead.models.gpt import GPT, GPTConfig

KINDS = list_attention_kinds()
BOTH = POSITIONAL["both"]
NORMS = ["qk_norm.q_norm.weight", "qk_norm.k_norm.weight"]


def _x(B: int, T: int, seed: int = 1, dtype=F64) -> torch.Tensor:
    return torch.randn(B, T, C, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _ref(*args, **kwargs) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(numpy_forward(*args, **kwargs)[0]))


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1e-10 scaled by the magnitude of ``want`` (the reference tolerance)."""
    _assert_matches(got.detach(), want.detach())


def _far(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a.detach() - b.detach()).abs().max()) > 1e-6


def test_every_registered_kind_has_a_row_in_the_table():
    missing = [k for k in KINDS if k not in OPTIONS]
    assert not missing, f"kinds without options in tests/support/kinds.py: {missing}"


# ---------------------------------------------------------------- reference
@pytest.mark.parametrize("positional", list(POSITIONAL))
@pytest.mark.parametrize("kind", KINDS)
def test_matches_numpy_reference(kind, positional):
    m = build(kind, **POSITIONAL[positional])
    x = _x(2, 5)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, 4] = False  # right padding
    out, w = m(x, is_causal=True, key_mask=keep, return_weights=True)
    want, want_w = numpy_forward(m, x, mask=keep[:, None, None, :].numpy(), is_causal=True)
    assert_matches(out, torch.from_numpy(want))
    assert_matches(w, torch.from_numpy(want_w))
    assert_matches(m(x, is_causal=True, key_mask=keep), torch.from_numpy(want))  # the no-weights path
    mem, pos = _x(2, 3, seed=2), torch.arange(5) + 3
    kw = {"positions": pos} if m.rope is not None else {}
    assert_matches(m(x, mem, **kw), _ref(m, x, mem, q_pos=pos.numpy() if kw else None))
    # the check is sensitive to each option: the reference without it is another function
    if m.rope is not None:
        assert _far(out, _ref(m, x, mask=keep[:, None, None, :].numpy(), is_causal=True, rope=False))
    if m.qk_norm is not None:
        assert _far(out, _ref(m, x, mask=keep[:, None, None, :].numpy(), is_causal=True, norm=False))


# ---------------------------------------------------------------- cache
@pytest.mark.parametrize("step", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_cached_decoding_equals_full(kind, step):
    m = build(kind, **BOTH)
    x = _x(2, 6)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 6)
    parts = [m(x[:, :2], is_causal=True, kv_cache=cache)]
    parts += [m(x[:, t : t + step], is_causal=True, kv_cache=cache) for t in range(2, 6, step)]
    assert cache.length == 6
    assert_paths_agree(torch.cat(parts, dim=1), full)


@pytest.mark.parametrize("kind", KINDS)
def test_left_padded_positions_with_and_without_cache(kind):
    m = build(kind, **BOTH)
    x = _x(2, 6)
    keep = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    pos = (keep.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]: real tokens count from 0
    full = m(x, is_causal=True, key_mask=keep, positions=pos)
    assert_matches(full, _ref(m, x, mask=keep[:, None, None, :].numpy(), is_causal=True, q_pos=pos.numpy()))
    assert_paths_agree(full[1:, 2:], m(x[1:, 2:], is_causal=True))  # the padded row's tokens, unpadded
    cache = m.make_kv_cache(2, 6)
    parts = [m(x[:, :4], is_causal=True, key_mask=keep[:, :4], positions=pos[:, :4], kv_cache=cache)]
    for t in (4, 5):
        parts.append(m(x[:, t : t + 1], is_causal=True, key_mask=keep[:, : t + 1],
                       positions=pos[:, t : t + 1], kv_cache=cache))  # fmt: skip
    assert_paths_agree(torch.cat(parts, dim=1)[keep], full[keep])
    # the cached keys were rotated at their own positions: a step at a wrong position differs
    wrong = m.make_kv_cache(2, 6)
    m(x[:, :5], is_causal=True, kv_cache=wrong)
    step = m(x[:, 5:], is_causal=True, kv_cache=wrong, positions=torch.tensor([0]))
    assert _far(step, m(x, is_causal=True)[:, 5:])


# ---------------------------------------------------------------- padding and masks
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_right_padding_does_not_change_the_real_rows(kind, causal):
    m = build(kind, **BOTH)
    x = _x(2, 4)
    padded = torch.cat([x, torch.full((2, 2, C), float("nan"), dtype=F64)], dim=1)  # NaN in the padding
    keep = torch.tensor([[True] * 4 + [False] * 2] * 2)
    got = m(padded, is_causal=causal, key_mask=keep)[:, :4]
    assert_paths_agree(got, m(x, is_causal=causal))


@pytest.mark.parametrize("kind", KINDS)
def test_bool_and_float_masks_2d_and_4d(kind):
    m = build(kind, **BOTH)
    x = _x(2, 5)
    g = torch.Generator().manual_seed(3)
    eye = torch.eye(5, dtype=torch.bool)  # every query row keeps a key
    for shape in ((5, 5), (2, H, 5, 5)):
        allow = (torch.rand(shape, generator=g) > 0.4) | eye
        got = m(x, attn_mask=allow)
        assert_matches(got, _ref(m, x, mask=allow.numpy()))
        zero_inf = torch.zeros(shape, dtype=F64).masked_fill(~allow, float("-inf"))
        assert_paths_agree(m(x, attn_mask=zero_inf), got)  # a 0/-inf float mask is the bool mask
        bias = torch.randn(shape, generator=g, dtype=F64).masked_fill(~allow, float("-inf"))
        assert_matches(m(x, attn_mask=bias), _ref(m, x, mask=bias.numpy()))


# ---------------------------------------------------------------- rope positions
@pytest.mark.parametrize("kind", KINDS)
def test_rope_positions(kind):
    m = build(kind, **BOTH)
    x = _x(2, 5)
    base = m(x, is_causal=True)
    assert_paths_agree(m(x, is_causal=True, positions=torch.arange(5)), base)  # explicit = default
    # self-attention scores depend on position differences only: a shift of all positions
    # (the same for every row, or per row) changes nothing
    assert_matches(m(x, is_causal=True, positions=torch.arange(5) + 37), base)
    assert_matches(m(x, is_causal=True, positions=torch.arange(5) + torch.tensor([[0], [11]])), base)
    # cross-attention keys sit at 0 .. S-1 whatever the queries' positions
    mem, pos = _x(2, 3, seed=2), torch.arange(5) + 7
    got = m(x, mem, positions=pos)
    assert_matches(got, _ref(m, x, mem, q_pos=pos.numpy()))
    assert _far(got, _ref(m, x, mem, q_pos=pos.numpy(), k_pos=pos[:3].numpy()))  # keys at the queries' offset
    assert _far(got, m(x, mem))  # so the query positions matter there


@pytest.mark.parametrize("kind", KINDS)
def test_option_errors(kind):
    with pytest.raises(ValueError, match="only used with rope"):
        build(kind)(_x(1, 3), positions=torch.arange(3))
    with pytest.raises(ValueError, match=r"\[T\] = \[3\]"):
        build(kind, rope=True)(_x(1, 3), positions=torch.arange(4))
    with pytest.raises(TypeError, match="qk_norm=1"):
        build_attention(kind, embed_dim=C, num_heads=H, qk_norm=1, **options(kind))
    with pytest.raises(ValueError, match="theta"):
        build_attention(kind, embed_dim=C, num_heads=H, rope={"theta": 1.0}, **options(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_options_off_are_bitwise_the_default(kind):
    default = build(kind)
    off = build(kind, seed=5, randomize=False, rope=False, qk_norm=False)
    assert off.rope is None and off.qk_norm is None
    assert list(off.state_dict()) == list(default.state_dict())
    off.load_state_dict(default.state_dict())
    x, mem = _x(2, 6), _x(2, 4, seed=2)
    # options off run the very same operations on the same shapes as the default: bitwise
    for args, kw in (((x,), {"is_causal": True}), ((x, mem), {}), ((x,), {"return_weights": True})):
        a, b = default(*args, **kw), off(*args, **kw)
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(u, v)
    caches = default.make_kv_cache(2, 6), off.make_kv_cache(2, 6)
    for t0, t1 in ((0, 3), (3, 4), (4, 6)):
        a, b = (mod(x[:, t0:t1], is_causal=True, kv_cache=c) for mod, c in zip((default, off), caches))
        assert torch.equal(a, b)


# ---------------------------------------------------------------- observers and kind
@pytest.mark.parametrize("kind", KINDS)
def test_observers_receive_the_mixing_weights(kind):
    m = build(kind, **BOTH)
    x = _x(2, 5)
    events = []
    handle = m.register_attention_observer(lambda module, event: events.append(event))
    out, w = m(x, is_causal=True, return_weights=True)
    plain = m(x, is_causal=True)
    handle.remove()
    m(x)
    assert len(events) == 2 and all(e.kind == m.kind == kind for e in events)
    assert torch.equal(events[0].weights, w)  # the weights the call returned, detached
    # weights with gradients come from the math path, an observer's alone from the fused kernel
    # where the kind's core selects them (selects_weights): two paths, within tolerance
    assert_paths_agree(events[1].weights, w.detach())
    assert_paths_agree(plain, out)
    assert events[1].heads == tuple(range(H)) and events[1].rows == tuple(range(5))
    q, k, _, _ = m.to_heads(x)
    q, k = m.position_qk(q, k, None, None)  # the forward's own steps on the same shapes: bitwise
    assert torch.equal(events[0].q, q) and torch.equal(events[0].k, k)
    if kind in SOFTMAX_KINDS:  # the scores the event describes give the weights
        k = k.repeat_interleave(H // k.shape[1], dim=1)  # (B, G, S, D) -> (B, H, S, D)
        scores = (q @ k.transpose(-1, -2) * events[0].scale).masked_fill(~torch.ones(5, 5).tril().bool(), -torch.inf)
        assert_paths_agree(torch.softmax(scores, -1), w)


@pytest.mark.parametrize("kind", KINDS)
def test_observers_of_some_heads_and_rows_get_their_part(kind):
    """Two observers asking for different heads and rows each get their slice of the full
    weights, and the output stays that of an unobserved call."""
    m = build(kind, **BOTH)
    x = _x(2, 6)
    with torch.no_grad():
        plain, w = m(x, is_causal=True, return_weights=True)
        events = {"a": [], "b": []}
        m.register_attention_observer(lambda mod, e: events["a"].append(e), heads=[1, 3], rows=slice(-2, None))
        m.register_attention_observer(lambda mod, e: events["b"].append(e), heads=[0], rows=[0, 4])
        out = m(x, is_causal=True)
    (a,), (b,) = events["a"], events["b"]
    assert (a.heads, a.rows, b.heads, b.rows) == ((1, 3), (4, 5), (0,), (0, 4))
    assert_paths_agree(a.weights, w[:, [1, 3]][:, :, 4:])
    assert_paths_agree(b.weights, w[:, [0]][:, :, [0, 4]])
    assert_paths_agree(out, plain)


@pytest.mark.parametrize("kind", KINDS)
def test_kind_is_a_plain_class_attribute(kind):
    m = build(kind, randomize=False)
    static = inspect.getattr_static(type(m), "kind")  # no descriptor runs
    assert isinstance(static, str), f"{type(m).__name__}.kind is {type(static).__name__}, not a class attribute"
    if "kind" in vars(m):  # a per-instance name set in __init__ over the class's family name
        assert isinstance(vars(m)["kind"], str)
    else:
        assert static == kind
    assert m.kind == kind


@pytest.mark.parametrize(
    "name,opts,want",
    [("mha", {}, "mha"), ("gqa", {"num_kv_heads": 2}, "gqa"), ("mqa", {}, "mqa"),
     ("gqa", {"num_kv_heads": 1}, "mqa"), ("gqa", {"num_kv_heads": 4}, "mha")],
)
def test_mha_family_names_each_instance_by_its_key_value_heads(name, opts, want):
    m = build_attention(name, embed_dim=C, num_heads=H, **opts)
    assert type(m).kind == "mha" and m.kind == want and vars(m)["kind"] == want
    assert type(m).kind_name(m.num_heads, m.num_kv_heads) == want  # the rule other code asks the class for


# ---------------------------------------------------------------- cost and state
@pytest.mark.parametrize("kind", KINDS)
def test_cost_matches_the_flop_counter(kind):
    """Non-causal, math backend, float64; the counted FLOPs equal ``cost()``
    less ``uncounted_flops`` (elementwise work a kind's cost counts). MoH is
    counted on its dense path, which ``cost(active_heads=H)`` describes."""
    m = build(kind)
    B, T = 2, 3
    x = _x(B, T)
    for key in (None, _x(B, 5, seed=2)):
        args = (x,) if key is None else (x, key)
        with FlopCounterMode(display=False) as counter:
            m(*args, backend="math", **COST_FORWARD.get(kind, {}))
        cost = m.cost(T, None if key is None else 5, batch=B, **COST_OPTIONS.get(kind, {}))
        assert counter.get_total_flops() == cost.total_flops - uncounted_flops(m, B, T), (key is None, cost)
    assert cost.parameters == sum(p.numel() for p in m.parameters())
    # rope and qk_norm add no counted FLOPs; the norm gains are parameters
    on = build(kind, **BOTH)
    c_on, c_off = on.cost(T, batch=B), m.cost(T, batch=B)
    gains = on.qk_norm.q_norm.weight.numel()
    assert c_on.parameters == sum(p.numel() for p in on.parameters()) == c_off.parameters + 2 * gains
    assert (c_on.core_flops, c_on.projection_flops) == (c_off.core_flops, c_off.projection_flops)
    assert "(rope): Rotary(" in repr(on)


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip(kind):
    m = build(kind, **BOTH)
    sd = m.state_dict()
    assert list(sd) == list(build(kind, randomize=False).state_dict()) + NORMS  # the norm gains come last
    fresh = build(kind, seed=7, randomize=False, **BOTH)
    fresh.load_state_dict(sd, strict=True)
    x, mem = _x(2, 5), _x(2, 3, seed=2)
    # the same module structure and weights, the same inputs: bitwise
    assert torch.equal(fresh(x, is_causal=True), m(x, is_causal=True))
    assert torch.equal(fresh(x, mem), m(x, mem))


# ---------------------------------------------------------------- aux_loss
@pytest.mark.parametrize("kind", KINDS)
def test_aux_loss_of_the_module(kind):
    m = build(kind, randomize=False)
    before = m.aux_loss()
    assert inspect.ismethod(m.aux_loss) and before.shape == () and before.dtype == F64 and float(before) == 0
    x = _x(2, 5)
    m.train()(x, is_causal=True)
    loss = m.aux_loss()
    assert loss.shape == () and torch.isfinite(loss)
    if kind in LOSS_KINDS:
        assert float(loss.detach()) > 0 and loss.requires_grad
    else:
        assert float(loss) == 0
    m.eval()(x, is_causal=True)
    loss = m.aux_loss()
    assert loss.shape == () and float(loss) == 0 and not loss.requires_grad and loss.dtype == F64
    m32 = build(kind, dtype=torch.float32, randomize=False)
    m32(_x(1, 3, dtype=torch.float32))
    assert m32.aux_loss().dtype == torch.float32 and m32.aux_loss().shape == ()


@pytest.mark.parametrize("kind", KINDS)
def test_aux_loss_reaches_the_model_and_cached_generation_agrees(kind):
    opts = options(kind)
    G = opts.pop("num_kv_heads", None)
    cfg = GPTConfig(vocab_size=32, context_length=16, embed_dim=C, num_layers=2, num_heads=H, num_kv_heads=G,
                    attention=kind, attention_options={**opts, **BOTH})  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg).train()
    idx = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(4))
    model(idx)
    total = model.aux_loss()
    layers = [block.attn.aux_loss() for block in model.blocks]
    assert torch.equal(total, torch.zeros(()) + layers[0] + layers[1])  # the same sum in the same order
    if kind in LOSS_KINDS:
        assert float(total.detach()) > 0 and total.requires_grad
        total.backward()
        assert any(p.grad is not None and bool(p.grad.ne(0).any()) for p in model.parameters())
    else:
        assert float(total) == 0
    assert_cached_generation_agrees(model.eval(), idx, 3)


# ---------------------------------------------------------------- cross-attention cache
@pytest.mark.parametrize("kind", KINDS)
def test_cross_attention_through_a_cache(kind):
    m = build(kind, **BOTH)
    x, mem = _x(2, 3), _x(2, 4, seed=2)
    cache = m.make_kv_cache(2, 4)
    first = m(x[:, :2], mem, mem, kv_cache=cache)  # fills the cache with mem's keys/values
    assert cache.length == 4
    later = m(x[:, 2:], mem, mem, kv_cache=cache, positions=torch.tensor([2]))  # reuses them
    assert cache.length == 4
    assert_paths_agree(first, m(x[:, :2], mem, mem))
    assert_paths_agree(later, m(x[:, 2:], mem, mem, positions=torch.tensor([2])))
    assert_matches(torch.cat([first, later], dim=1), _ref(m, x, mem))  # queries 0..2, keys 0..S-1
    with pytest.raises(ValueError, match="another key tensor"):
        m(x, mem.clone(), kv_cache=cache)
    with pytest.raises(ValueError, match="cross-attention keys"):
        m(x, kv_cache=cache)
    assert cache.length == 4
    own = m.make_kv_cache(2, 6)
    m(x, is_causal=True, kv_cache=own)
    with pytest.raises(ValueError, match="self-attention positions"):
        m(x, mem, kv_cache=own)
    assert own.length == 3
    # a fill that fails (a wrong mask, no room) leaves the cache empty and usable
    fresh = m.make_kv_cache(2, 4)
    with pytest.raises(ValueError, match="mask"):
        m(x, mem, kv_cache=fresh, attn_mask=torch.ones(2, 2, dtype=torch.bool))
    assert fresh.length == 0
    with pytest.raises(ValueError):
        m(x, mem, kv_cache=m.make_kv_cache(2, 3))
    other = _x(2, 4, seed=9)
    assert_paths_agree(m(x, other, kv_cache=fresh), m(x, other))
    assert fresh.length == 4


# ---------------------------------------------------------------- torch.compile
@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile_calls(attn):
    """Forward with a padding mask and no cache, then prefill and one decoding step."""

    def run(x, nxt, keep, cache):
        padded = attn(x, is_causal=True, key_mask=keep)
        prefill = attn(x, is_causal=True, kv_cache=cache)
        step = attn(nxt, is_causal=True, kv_cache=cache)
        return padded, prefill, step

    return run


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_compiles_without_graph_breaks_to_the_eager_numbers(kind, fresh_dynamo):
    """``torch._dynamo.explain`` counts graph breaks and runs the captured graph
    op by op; float32, compared with eager at torch.testing's defaults."""
    attn = build(kind, dtype=torch.float32, randomize=False, **BOTH)
    x, nxt = _x(2, 5, dtype=torch.float32), _x(2, 1, seed=2, dtype=torch.float32)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1, :2] = False  # left padding in batch row 1
    got_cache, want_cache = attn.make_kv_cache(2, 8), attn.make_kv_cache(2, 8)
    with torch.no_grad():
        explained, got = explain_and_run(_compile_calls(attn), x, nxt, keep, got_cache)
        want = _compile_calls(attn)(x, nxt, keep, want_cache)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert got_cache.length == want_cache.length
    for name, buf in want_cache.named_buffers():  # both started as zeros: whole buffers compare
        torch.testing.assert_close(getattr(got_cache, name), buf)


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(LOSS_KINDS))
def test_training_forward_traces_without_graph_breaks(kind, fresh_dynamo):
    """The kinds whose training forward differs: MoH's balance loss, the gates' sampling."""
    attn = build(kind, dtype=torch.float32, randomize=False).train()
    x = _x(2, 5, dtype=torch.float32)
    keep = torch.ones(2, 5, dtype=torch.bool)
    explained = torch._dynamo.explain(lambda x, keep: attn(x, is_causal=True, key_mask=keep))(x, keep)
    assert explained.graph_break_count == 0, explained.break_reasons
