"""GPT under torch.compile(fullgraph=True): the forward and a cached decoding
step trace without graph breaks and give the eager logits; decoding step after
step compiles twice in all; one real inductor compile of a decoding step.

Graph breaks are counted with ``torch._dynamo.explain``, whose run of the
captured graph (op by op) also gives the compiled numbers; compared with eager
mode at float32 tolerance (torch.testing defaults).
"""

import shutil

import pytest
import torch
from support.compile import explain_and_run
from torch._dynamo.testing import CompileCounter

from multihead.models import GPT, GPTConfig

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(**overrides):
    torch.manual_seed(0)
    config = dict(vocab_size=61, context_length=32, embed_dim=32, num_layers=2, num_heads=4)
    return GPT(GPTConfig(**{**config, **overrides})).eval()


def _prompt():
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, 61, (2, 6), generator=g)
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # row 1 is left-padded
    return idx, mask


def _assert_same_caches(got, want):
    for g, w in zip(got, want):
        assert g.length == w.length
        torch.testing.assert_close(g.k, w.k)
        torch.testing.assert_close(g.v, w.v)


def test_gpt_forward_compiles_without_graph_breaks():
    model = _model(attention="gqa", num_kv_heads=2)
    idx, mask = _prompt()

    def run(idx, mask):
        return model(idx), model(idx, attention_mask=mask)

    with torch.no_grad():
        explained, got = explain_and_run(run, idx, mask)
        want = run(idx, mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    torch.testing.assert_close(got, want)


def test_gpt_cached_decoding_step_compiles_without_graph_breaks():
    model = _model(attention="gqa", num_kv_heads=2)
    idx, mask = _prompt()
    nxt = torch.tensor([[7], [11]])
    got_caches, want_caches = model.make_kv_caches(2, 16), model.make_kv_caches(2, 16)
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)  # (B, S + 1)

    def step(nxt, mask, caches):
        return model(nxt, attention_mask=mask, kv_caches=caches)

    with torch.no_grad():
        model(idx, attention_mask=mask, kv_caches=got_caches)
        model(idx, attention_mask=mask, kv_caches=want_caches)
        explained, got = explain_and_run(step, nxt, step_mask, got_caches)
        want = step(nxt, step_mask, want_caches)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    torch.testing.assert_close(got, want)
    _assert_same_caches(got_caches, want_caches)


def test_gpt_decoding_compiles_twice_for_many_steps():
    """Ten padded decoding steps (more than the recompile limit of 8): the first
    new cache length recompiles once, then one graph serves every step. (The
    caches are not filled to max_len: a view of a whole buffer is contiguous,
    which makes one more graph.)"""
    model = _model()
    idx, mask = _prompt()
    counter = CompileCounter()
    step = torch.compile(
        lambda nxt, mask, caches: model(nxt, attention_mask=mask, kv_caches=caches), fullgraph=True, backend=counter
    )
    got_caches, want_caches = model.make_kv_caches(2, 20), model.make_kv_caches(2, 20)
    with torch.no_grad():
        model(idx, attention_mask=mask, kv_caches=got_caches)
        logits = model(idx, attention_mask=mask, kv_caches=want_caches)
        for _ in range(10):
            nxt = logits[:, -1:].argmax(-1)  # (B, 1)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            got = step(nxt, mask, got_caches)
            logits = model(nxt, attention_mask=mask, kv_caches=want_caches)
            torch.testing.assert_close(got, logits)
    assert counter.frame_count == 2
    _assert_same_caches(got_caches, want_caches)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler")
def test_gpt_decoding_step_with_inductor():
    """The one real inductor compile of the suite: generated C++ kernels, the
    cache written in place, the eager logits."""
    model = _model(attention="gqa", num_kv_heads=2)
    idx, _ = _prompt()
    got_caches, want_caches = model.make_kv_caches(2, 16), model.make_kv_caches(2, 16)
    step = torch.compile(lambda nxt, caches: model(nxt, kv_caches=caches), fullgraph=True)
    with torch.no_grad():
        model(idx, kv_caches=got_caches)
        model(idx, kv_caches=want_caches)
        got = step(idx[:, -1:], got_caches)
        want = model(idx[:, -1:], kv_caches=want_caches)
    torch.testing.assert_close(got, want)
    _assert_same_caches(got_caches, want_caches)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="inductor needs a C++ compiler")
def test_generate_with_compiled_steps_gives_the_eager_tokens():
    """``generate(compile_steps=True)``: the one-token steps through inductor, the same greedy tokens and logits."""
    model = _model(attention="gqa", num_kv_heads=2)
    idx, _ = _prompt()
    with torch.no_grad():
        got, got_logits = model.generate(idx, 6, temperature=0, compile_steps=True, return_logits=True)
        want, want_logits = model.generate(idx, 6, temperature=0, return_logits=True)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits)
    with pytest.raises(TypeError, match="compile_steps must be a bool, got 1"):
        model.generate(idx, 1, compile_steps=1)
