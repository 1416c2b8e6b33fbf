"""Decoding steps without host reads, and the fixed-shape steps ``compile_steps`` records as a CUDA graph.

Host reads are counted with ``torch.profiler`` (``aten::_local_scalar_dense``,
what ``.item()``, ``int()`` and ``bool()`` of a tensor run); a step's count is
the difference between two ``generate`` calls of different lengths, so the
prompt's one check and the prefill cancel out. The only reads a step may make
are the attention's own non-finite check per layer (eager on CPU, counted on
one ``functional.attention`` call) and, with ``eos``, the early-stop check.

The ``GraphKVCache`` steps are compared with the ``KVCache`` steps at float32
tolerance (torch.testing defaults); on CPU their compile runs dynamo with
``CompileCounter`` (the captured graph run op by op), on CUDA inductor with
mode="reduce-overhead".
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.profiler import ProfilerActivity, profile

from multihead.functional import attention
from multihead.models import generation
from multihead.models.decode_steps import GraphSteps, uses_cuda_graphs
from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.graph_cache import GraphKVCache, supports_graph_steps

LAYERS = 2


def _model(device="cpu", **overrides) -> GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=61, context_length=32, embed_dim=32, num_layers=LAYERS, num_heads=4)
    return GPT(GPTConfig(**{**config, **overrides}), device=device).eval()


def _prompt(device="cpu", rows=2) -> torch.Tensor:
    return torch.randint(0, 61, (rows, 5), generator=torch.Generator().manual_seed(3)).to(device)


def _host_reads(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")


def _reads_per_step(model, idx, **kw) -> float:
    short = _host_reads(lambda: model.generate(idx, 2, **kw))
    long = _host_reads(lambda: model.generate(idx, 8, **kw))
    return (long - short) / 6


def _attention_reads(masked: bool = False) -> int:
    """Host reads of one eager attention call as a decoding step makes it: its non-finite
    check, and with a key mask the sdpa path's check that every row sees a key."""
    q = torch.randn(2, 4, 1, 8)
    k = v = torch.randn(2, 4, 3, 8)
    mask = torch.tensor([[False, True, True], [True, True, True]])[:, None, None, :] if masked else None
    return _host_reads(lambda: attention(q, k, v, attn_mask=mask, is_causal=True, causal_alignment="bottom_right"))


def _sampler_reads(**kw) -> int:
    """Host reads of one ``sample_next_token``: none for argmax; torch.multinomial's
    ``_assert_async`` on CPU (a device-side assert on CUDA)."""
    kw = {k: v for k, v in kw.items() if k in ("temperature", "top_k", "top_p", "generator")}
    return _host_reads(lambda: generation.sample_next_token(torch.randn(2, 61), **kw))


PADDED = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0),
        dict(temperature=0.8, top_k=5, top_p=0.9, generator=torch.Generator().manual_seed(0)),
        dict(temperature=0, use_cache=False),
        dict(temperature=0, attention_mask=PADDED),
    ],
    ids=["greedy", "sampling", "no cache", "padded"],
)
def test_a_decoding_step_reads_back_only_what_its_layers_and_sampler_do(kw):
    """No token-id range check, no .item() of the loop: per step each layer's attention
    checks and what the sampling op itself reads."""
    model = _model()
    want = LAYERS * _attention_reads("attention_mask" in kw) + _sampler_reads(**kw)
    assert _reads_per_step(model, _prompt(), **kw) == want


def test_with_eos_a_step_reads_back_once_more_for_the_early_stop():
    model = _model()
    assert _reads_per_step(model, _prompt(), temperature=0, eos=60) == LAYERS * _attention_reads() + 1


def test_a_prompt_id_out_of_range_is_refused_before_decoding():
    """The prompt is checked once, with the forward's message."""
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 61\), got min 0, max 61"):
        _model().generate(torch.tensor([[0, 61]]), 3)


def test_graph_kv_cache_steps_give_the_kv_cache_logits():
    """One token per call at the device-side position, over every slot of the buffers (eager)."""
    model, idx = _model(), _prompt()
    with torch.no_grad():
        want_caches, got_caches = model.make_kv_caches(2, 12), model.make_kv_caches(2, 12)
        want = model(idx, kv_caches=want_caches)[:, -1:].argmax(-1)
        model(idx, kv_caches=got_caches)
        position = torch.full((1,), idx.shape[1], dtype=torch.long)
        graph = [GraphKVCache(c, position) for c in got_caches]
        for _ in range(6):
            got_logits = model(want, kv_caches=graph)
            position.add_(1)
            want_logits = model(want, kv_caches=want_caches)
            torch.testing.assert_close(got_logits, want_logits)
            want = want_logits.argmax(-1)
        for g, c in zip(graph, want_caches):  # the same keys and values written at the same slots
            torch.testing.assert_close(g.k[:, :, : c.length], c.k[:, :, : c.length])


def test_graph_kv_cache_refusals():
    model, idx = _model(), _prompt()
    caches = model.make_kv_caches(2, 12)
    with torch.no_grad():
        model(idx, kv_caches=caches)
    position = torch.full((1,), 5, dtype=torch.long)
    graph = [GraphKVCache(c, position) for c in caches]
    with pytest.raises(ValueError, match="takes one token per call, got 2"):
        model(idx[:, :2], kv_caches=graph)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        model(idx[:, :1], kv_caches=graph, attention_mask=torch.ones(2, 12))
    with pytest.raises(ValueError, match="block 1: every block needs a GraphKVCache sharing"):
        model(idx[:, :1], kv_caches=[graph[0], GraphKVCache(caches[1], position.clone())])
    with pytest.raises(TypeError, match="position must be a \\[1\\] torch.long tensor"):
        GraphKVCache(caches[0], torch.tensor(5))
    rope = _model(positions="rope")
    rope_caches = [GraphKVCache(c, position) for c in rope.make_kv_caches(2, 12)]
    with pytest.raises(ValueError, match="block 0's attention \\(mha\\) cannot decode over a GraphKVCache"):
        rope(idx[:, :1], kv_caches=rope_caches)


def test_which_models_decode_over_graph_caches():
    """CUDA only (CPU keeps the growing cache), and only attention whose scores ignore where a key sits."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    model = _model(attention="gqa", num_kv_heads=2)
    assert all(supports_graph_steps(b.attn) for b in model.blocks)
    assert uses_cuda_graphs(model, model.make_kv_caches(1, 4), cuda)
    assert not uses_cuda_graphs(model, model.make_kv_caches(1, 4), cpu)
    for other in (_model(positions="rope"), _model(positions="alibi"), _model(attention_options={"window": 4})):
        assert not uses_cuda_graphs(other, other.make_kv_caches(1, 4), cuda)
    assert not supports_graph_steps(torch.nn.Linear(4, 4))  # not an attention layer at all


@pytest.fixture
def graph_steps_on_cpu(monkeypatch):
    """generate's CUDA-graph path on CPU, compiled with a CompileCounter (dynamo only)."""
    torch._dynamo.reset()
    counter = CompileCounter()
    monkeypatch.setattr(generation, "compiled_steps", lambda model, caches, device: GraphSteps(
        model, {"backend": counter}))  # fmt: skip
    yield counter
    torch._dynamo.reset()


@pytest.mark.parametrize("kw", [dict(), dict(eos=7)], ids=["plain", "eos"])
def test_graph_steps_give_the_eager_tokens_and_compile_once(graph_steps_on_cpu, kw):
    """Every step and a second call: one graph, no recompile, the eager tokens and logits."""
    model, idx = _model(), _prompt()
    want, want_logits = model.generate(idx, 9, temperature=0, return_logits=True, **kw)
    for _ in range(2):
        got, got_logits = model.generate(idx, 9, temperature=0, return_logits=True, compile_steps=True, **kw)
        assert torch.equal(got, want)
        torch.testing.assert_close(got_logits, want_logits)
    assert graph_steps_on_cpu.frame_count == 1


def test_graph_steps_of_other_prompt_lengths_and_token_counts_reuse_the_one_compile(graph_steps_on_cpu):
    """catches: step buffers sized by the call (prompt + new tokens), which recompile for every
    new size and, past dynamo's recompile limit, raise."""
    model, idx = _model(), _prompt()
    for prompt, new in ((idx, 9), (idx[:, :3], 4), (idx[:, :4], 15)):
        want = model.generate(prompt, new, temperature=0)
        assert torch.equal(model.generate(prompt, new, temperature=0, compile_steps=True), want)
    assert graph_steps_on_cpu.frame_count == 1


def test_graph_steps_stop_at_the_context_and_slide_on(graph_steps_on_cpu):
    """Past context_length the window slides with eager steps, as without compile_steps."""
    model, idx = _model(context_length=8), _prompt()
    want = model.generate(idx, 7, temperature=0)
    assert torch.equal(model.generate(idx, 7, temperature=0, compile_steps=True), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_steps_replay_without_host_reads_or_recompiles():
    """On CUDA ``compile_steps=True`` records one CUDA graph (inductor, mode="reduce-overhead"):
    no cudagraph skip, no recompile over two calls, no host read per step, the eager tokens."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, idx = _model("cuda"), _prompt("cuda")
    with torch.no_grad():
        want, want_logits = model.generate(idx, 12, temperature=0, return_logits=True)
        got, got_logits = model.generate(idx, 12, temperature=0, return_logits=True, compile_steps=True)
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = model.generate(idx, 12, temperature=0, compile_steps=True)
            # 11 compiled steps read back no more than none: the prompt check and the prefill are the same
            steps = _host_reads(lambda: model.generate(idx, 12, temperature=0, compile_steps=True))
            prefill = _host_reads(lambda: model.generate(idx, 1, temperature=0, compile_steps=True))
    torch._dynamo.reset()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert steps == prefill
    assert torch.equal(got, want) and torch.equal(again, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
