"""``functional.attention`` under torch.compile(fullgraph=True): no graph breaks,
the eager numbers, and the defined outputs (hidden NaN/inf ignored, visible NaN
kept, rows that see nothing give zeros and zero gradients) without host syncs.

Graph breaks are counted with ``torch._dynamo.explain``, whose run of the
captured graph (op by op, as ``backend="eager"``) also gives the compiled
numbers; with gradients ``backend="aot_eager"`` (AOT autograd) is used. Neither
compiles C++. Both are compared with eager mode at float32 tolerance (torch.testing defaults):
the compiled graph takes the branch-free path, eager its fast path.
"""

import pytest
import torch
from support.attention import BACKENDS, assert_matches, make_qkv, run_reference
from support.compile import explain_and_run

from multihead.functional import attention, padding_mask_from_lengths

pytestmark = pytest.mark.slow
both = pytest.mark.parametrize("backend", BACKENDS)
F32 = torch.float32


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _requests(backend):
    """A function making one attention call per request kind (all shapes fixed)."""

    def run(q, k, v, keep, float_mask, gq, gk, gv):
        return (
            attention(q, k, v, backend=backend),
            attention(q, k, v, is_causal=True, backend=backend),
            attention(q, k, v, is_causal=True, causal_alignment="bottom_right", backend=backend),
            attention(q, k, v, attn_mask=keep, is_causal=True, backend=backend),
            attention(q, k, v, attn_mask=float_mask, backend=backend),
            attention(gq, gk, gv, is_causal=True, backend=backend),  # GQA, T != S
        )

    return run


def _request_inputs(seed):
    q, k, v = make_qkv(seed, 2, 4, 4, 5, 6, 8, dtype=F32)
    keep = padding_mask_from_lengths([6, 3], 6)  # (B, 1, 1, S)
    float_mask = torch.from_numpy(seed.standard_normal((5, 6))).float()
    float_mask[1, 2:] = float("-inf")
    gq, gk, gv = make_qkv(seed, 2, 4, 2, 3, 7, 8, dtype=F32)
    return q, k, v, keep, float_mask, gq, gk, gv


@both
def test_attention_compiles_without_graph_breaks_to_the_eager_numbers(backend, seed):
    args = _request_inputs(seed)
    explained, got = explain_and_run(_requests(backend), *args)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    for g, w in zip(got, _requests(backend)(*args)):
        torch.testing.assert_close(g, w)


def _poisoned(seed):
    """float32 inputs with NaN/inf behind the mask, a visible NaN, and rows
    that see nothing (a bool row of False, a float row of -inf)."""
    B, H, G, T, S = 2, 4, 2, 5, 6
    q, k, v = make_qkv(seed, B, H, G, T, S, 8, dtype=F32)
    clean_k = k.clone()
    visible_v = v.clone()
    visible_v[0, 1, 3, 2] = float("nan")  # group 1, batch 0: seen by every query without a mask
    keep = padding_mask_from_lengths([6, 4], S)  # batch 1: keys 4, 5 are padding
    k[1, :, 4, 0] = float("nan")
    v[1, :, 5, 1] = float("inf")
    v[1, :, 4, 2] = -float("inf")
    bool_mask = torch.ones(T, S, dtype=torch.bool)
    bool_mask[2] = False  # query 2 sees nothing
    float_mask = torch.zeros(T, S)
    float_mask[0] = float("-inf")  # query 0 sees nothing
    return q, k, v, keep, bool_mask, float_mask, clean_k, visible_v


def _guarantees(backend):
    def run(q, k, v, keep, bool_mask, float_mask, clean_k, visible_v):
        return (
            attention(q, k, v, attn_mask=keep, backend=backend),
            attention(q, k, v, attn_mask=keep, is_causal=True, backend=backend),
            attention(q, k, v, attn_mask=keep & bool_mask, backend=backend),
            attention(q, k, v, attn_mask=float_mask.masked_fill(~keep, float("-inf")), backend=backend),
            attention(q.detach(), clean_k, visible_v, backend=backend),
        )

    return run


@both
def test_compiled_attention_keeps_the_defined_outputs(backend, seed):
    """Hidden NaN/inf change nothing, a visible NaN stays, empty rows are 0 with
    zero gradients: the same numbers and gradients as eager mode."""
    inputs = _poisoned(seed)
    leaves = [t.requires_grad_() for t in inputs[:3]]
    compiled = torch.compile(_guarantees(backend), fullgraph=True, backend="aot_eager")
    got = compiled(*inputs)
    want = _guarantees(backend)(*inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, equal_nan=True)
    hidden_ok = got[:4]
    for out in hidden_ok:
        assert bool(torch.isfinite(out).all())
    assert torch.equal(got[2][:, :, 2], torch.zeros_like(got[2][:, :, 2]))  # bool row of False
    assert torch.equal(got[3][:, :, 0], torch.zeros_like(got[3][:, :, 0]))  # float row of -inf
    visible = got[4]
    assert bool(torch.isnan(visible[0, 2:4, :, 2]).all())  # heads 2, 3 read group 1
    assert not bool(torch.isnan(visible[0, :2]).any()) and not bool(torch.isnan(visible[1]).any())

    cotangents = [torch.randn_like(out) for out in hidden_ok]

    def grads(outs):
        loss = sum((o * c).sum() for o, c in zip(outs, cotangents))
        return torch.autograd.grad(loss, leaves, retain_graph=True)

    for g, w in zip(grads(hidden_ok), grads(want[:4])):
        assert bool(torch.isfinite(g).all())
        torch.testing.assert_close(g, w)
    # A query row that sees nothing gets a zero gradient from that call.
    for call, row in ((2, 2), (3, 0)):
        (gq,) = torch.autograd.grad((got[call] * cotangents[call]).sum(), leaves[0], retain_graph=True)
        assert torch.equal(gq[:, :, row], torch.zeros_like(gq[:, :, row]))


def test_compiled_half_precision_float_mask_served_by_math(seed):
    """With half inputs a float mask cannot be range-checked inside the graph, so
    ``auto`` takes the math path there: the eager math numbers, no graph break."""
    q, k, v = make_qkv(seed, 2, 4, 2, 5, 6, 8, dtype=torch.float16)
    m = torch.from_numpy(seed.standard_normal((5, 6))).float()
    m[0] = torch.finfo(torch.float32).min

    def run(q, k, v, m):
        return attention(q, k, v, attn_mask=m)

    explained, got = explain_and_run(run, q, k, v, m)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(got, attention(q, k, v, attn_mask=m, backend="math"))


def _branch_free_cases(seed):
    """(name, q, k, v, kwargs): masks of every structure the patch handles
    (none, per key, causal, per row and head), with NaN/inf hidden and visible."""
    B, H, G, T, S = 2, 4, 2, 7, 5  # T > S: top-left rows past S, bottom-right rows that see nothing
    q, k, v = make_qkv(seed, B, H, G, T, S, 3, 4, dtype=torch.float64)
    q[0, 1, 0, 0] = float("nan")  # query row 0: sees no key when bottom-right
    k[1, 0, 4, 1] = float("nan")  # the last key: hidden from early causal rows
    v[0, 1, 3, 2] = float("inf")
    v[0, 1, 1, 2] = -float("inf")
    v[1, 0, 2, 0] = float("inf")
    k[1, 1, 0, 2] = float("nan")  # keys 0 and 1 of batch row 1 are padding below
    v[1, :, 1, 3] = -float("inf")
    keep = padding_mask_from_lengths([5, 3], S, left=True)  # (B, 1, 1, S)
    per_row = torch.from_numpy(seed.random((T, S)) < 0.7)
    per_head = torch.from_numpy(seed.random((1, H, T, S)) < 0.7)
    per_head[0, 2, 1] = False  # a row that sees nothing
    float_mask = torch.from_numpy(seed.standard_normal((B, 1, 1, S)))
    float_mask[1, 0, 0, :3] = float("-inf")
    float_mask[0] = float("-inf")  # batch row 0 (with the NaN query) sees nothing
    return [
        ("no mask", {}),
        ("causal top-left", {"is_causal": True}),
        ("causal bottom-right", {"is_causal": True, "causal_alignment": "bottom_right"}),
        ("padding", {"attn_mask": keep}),
        ("padding and causal", {"attn_mask": keep, "is_causal": True}),
        ("float padding with -inf", {"attn_mask": float_mask}),
        ("float padding with -inf and causal", {"attn_mask": float_mask, "is_causal": True}),
        ("per row", {"attn_mask": per_row}),
        ("per head and causal", {"attn_mask": per_head, "is_causal": True}),
    ], (q, k, v)


@both
def test_branch_free_path_equals_the_eager_path_and_the_reference(backend, seed, monkeypatch):
    """What compiled code runs (sanitise always, patch masks always, no host
    sync), run in eager mode by making ``torch.compiler.is_compiling`` say True:
    on clean and on poisoned inputs, for every mask structure, the outputs
    (NaN/inf pattern included) match the NumPy reference and the eager path
    (its fast path on clean inputs), and so do the gradients. float64."""
    cases, poisoned = _branch_free_cases(seed)
    clean = tuple(torch.where(torch.isfinite(t), t, 0.5) for t in poisoned)
    for inputs in (clean, poisoned):
        for name, kw in cases:
            leaves = [t.clone().requires_grad_() for t in inputs]
            want = attention(*leaves, backend=backend, **kw)
            with monkeypatch.context() as patch:
                patch.setattr(torch.compiler, "is_compiling", lambda: True)
                got = attention(*leaves, backend=backend, **kw)
            ref, _ = run_reference(*inputs, kw.get("attn_mask"), is_causal=kw.get("is_causal", False),
                                   causal_alignment=kw.get("causal_alignment", "top_left"))
            assert_matches(got, ref)
            torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m, name=name: f"{name}: {m}")
            finite = torch.isfinite(want).all(-1, keepdim=True)  # rows without NaN/inf
            cot = torch.randn_like(want).masked_fill(~finite, 0.0)
            g_want = torch.autograd.grad(want.masked_fill(~finite, 0.0).mul(cot).sum(), leaves)
            g_got = torch.autograd.grad(got.masked_fill(~finite, 0.0).mul(cot).sum(), leaves)
            for g, w in zip(g_got, g_want):
                torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name} gradient: {m}")
