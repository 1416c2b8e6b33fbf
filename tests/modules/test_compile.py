"""Attention modules under torch.compile(fullgraph=True): ``MultiHeadAttention``'s
call variants trace without a graph break, give the eager numbers, and write
the same KV cache (every kind from ``build_attention``: tests/modules/test_contract.py).

Graph breaks are counted with ``torch._dynamo.explain``, whose run of the
captured graph (op by op, as ``backend="eager"``) also gives the compiled
numbers; gradients come from ``backend="aot_eager"`` (AOT autograd). Both are
compared with eager mode at float32 tolerance (torch.testing defaults).
Modules are float32 and small; no C++ is compiled here.
"""

import pytest
import torch
from support.compile import explain_and_run
from torch._dynamo.testing import CompileCounter

from multihead import MultiHeadAttention

pytestmark = pytest.mark.slow

C, H = 16, 4


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _inputs(B=2, T=5):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, T, C, generator=g)
    nxt = torch.randn(B, 1, C, generator=g)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, :2] = False  # left padding in batch row 1
    return x, nxt, keep


def _assert_same_cache(got, want):
    """Same length and buffers (both started as zeros, so whole buffers compare)."""
    assert got.length == want.length
    for name, buf in want.named_buffers():
        torch.testing.assert_close(getattr(got, name), buf)


# ----------------------------------------------------------- MultiHeadAttention

def _mha_case(name):
    """(module, call(module, x, nxt, keep, cache) -> outputs) for one call variant."""
    g = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    if name == "masks_bool":
        m = MultiHeadAttention(C, H, num_kv_heads=2)
        causal = torch.ones(5, 5, dtype=torch.bool).tril()
        return m, lambda m, x, nxt, keep, cache: m(x, attn_mask=causal, key_mask=keep)
    if name == "masks_float":
        m = MultiHeadAttention(C, H)
        bias = torch.randn(1, H, 5, 5, generator=g)
        bias[0, 1, 3] = float("-inf")  # one row that sees nothing
        return m, lambda m, x, nxt, keep, cache: m(
            x, attn_mask=bias, key_mask=keep.float().log()  # 0 or -inf
        )
    if name == "weights_and_cross":
        m = MultiHeadAttention(C, H, kdim=7, vdim=3)
        mem_k, mem_v = torch.randn(2, 6, 7, generator=g), torch.randn(2, 6, 3, generator=g)
        return m, lambda m, x, nxt, keep, cache: m(x, mem_k, mem_v, return_weights=True)
    if name == "rope_qk_norm_cache":
        m = MultiHeadAttention(C, H, num_kv_heads=1, rope=True, qk_norm=True)
        return m, lambda m, x, nxt, keep, cache: (
            m(x, is_causal=True, kv_cache=cache),
            m(nxt, is_causal=True, kv_cache=cache),
        )
    raise AssertionError(name)


MHA_CASES = ["masks_bool", "masks_float", "weights_and_cross", "rope_qk_norm_cache"]


@pytest.mark.parametrize("name", MHA_CASES)
def test_mha_call_variants_compile_without_graph_breaks(name):
    m, call = _mha_case(name)
    m.eval()
    x, nxt, keep = _inputs()

    def run(x, nxt, keep, cache):
        return call(m, x, nxt, keep, cache)

    got_cache, want_cache = m.make_kv_cache(2, 8), m.make_kv_cache(2, 8)
    with torch.no_grad():
        explained, got = explain_and_run(run, x, nxt, keep, got_cache)
        want = run(x, nxt, keep, want_cache)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch.testing.assert_close(got, want)
    _assert_same_cache(got_cache, want_cache)


def test_mha_gradients_through_compiled_forward():
    """aot_eager: AOT autograd's backward gives the eager gradients, including
    zero gradients for the query rows a padding mask leaves with no key."""
    torch.manual_seed(0)
    m = MultiHeadAttention(C, H, num_kv_heads=2)
    x, _, keep = _inputs()
    keep[0, :] = False  # batch row 0 sees nothing at all
    x.requires_grad_()

    def run(x, keep):
        return m(x, key_mask=keep, is_causal=True)

    got = torch.compile(run, fullgraph=True, backend="aot_eager")(x, keep)
    want = run(x, keep)
    torch.testing.assert_close(got, want)
    cot = torch.randn_like(want)
    leaves = [x, *m.parameters()]
    got_grads = torch.autograd.grad((got * cot).sum(), leaves)
    for g, w in zip(got_grads, torch.autograd.grad((want * cot).sum(), leaves)):
        torch.testing.assert_close(g, w)
    assert torch.equal(got[0], m.out_proj.bias.expand_as(got[0]).detach())  # every head gives 0
    assert torch.equal(got_grads[0][0], torch.zeros_like(got_grads[0][0]))


def test_mha_decoding_compiles_twice_for_many_steps():
    """The cache length is read as an unspecialised int: the first new length
    recompiles once, then one graph serves every step (no recompile limit hit)."""
    torch.manual_seed(0)
    m = MultiHeadAttention(C, H, num_kv_heads=2, rope=True).eval()
    g = torch.Generator().manual_seed(3)
    prompt, steps = torch.randn(2, 3, C, generator=g), torch.randn(2, 12, C, generator=g)
    counter = CompileCounter()
    step = torch.compile(lambda x, cache: m(x, is_causal=True, kv_cache=cache), fullgraph=True, backend=counter)
    got_cache, want_cache = m.make_kv_cache(2, 16), m.make_kv_cache(2, 16)
    with torch.no_grad():
        m(prompt, is_causal=True, kv_cache=got_cache)
        m(prompt, is_causal=True, kv_cache=want_cache)
        for t in range(steps.shape[1]):  # more steps than the recompile limit (8)
            got = step(steps[:, t : t + 1], got_cache)
            want = m(steps[:, t : t + 1], is_causal=True, kv_cache=want_cache)
            torch.testing.assert_close(got, want)
    assert counter.frame_count == 2
    _assert_same_cache(got_cache, want_cache)
