"""docs/adding-a-kind.md: its worked example runs as written and is a correct kind.

The python blocks of the page are executed in one namespace; the kind they
register is removed from the registry again when each test ends, so tests
that iterate ``list_attention_kinds()`` never see it.
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from support.paths import assert_paths_agree

from multihead import MultiHeadAttention, build_attention, list_attention_kinds
from multihead.modules import registry
from multihead.modules.base import AttentionLayer
from multihead.reference.attention import attention as reference_attention

PAGE = Path(__file__).resolve().parents[2] / "docs" / "adding-a-kind.md"
NAME = "scaled_heads"
F64 = torch.float64


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)


@contextmanager
def _documented_kind():
    """Run the page's python blocks; yield their namespace; unregister the kind."""
    assert NAME not in list_attention_kinds(), f"{NAME!r} is registered before the page runs"
    namespace: dict = {"__name__": "adding_a_kind_example"}
    try:
        for block in _python_blocks():
            exec(compile(block, str(PAGE), "exec"), namespace)
        yield namespace
    finally:
        registry._KINDS.pop(NAME, None)


@pytest.fixture
def kind(capsys):
    """The documented kind's class, registered for the duration of one test."""
    with _documented_kind() as namespace:
        capsys.readouterr()  # the usage block's print
        yield namespace["ScaledHeadAttention"]


def _build(**options) -> AttentionLayer:
    torch.manual_seed(0)
    m = build_attention(NAME, embed_dim=20, num_heads=4, dtype=F64, **options)
    with torch.no_grad():
        m.log_temperature.copy_(torch.tensor([0.7, -0.4, 0.0, 1.1], dtype=F64))  # away from plain MHA
    return m


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


def _heads(x: np.ndarray, n: int) -> np.ndarray:
    B, L, _ = x.shape
    return x.reshape(B, L, n, -1).transpose(0, 2, 1, 3)  # (B, L, n*D) -> (B, n, L, D)


def _linear(x: np.ndarray, layer: torch.nn.Linear) -> np.ndarray:
    return x @ _np(layer.weight).T + _np(layer.bias)


def test_the_page_runs_registers_the_kind_and_unregisters_it(capsys):
    blocks = _python_blocks()
    assert len(blocks) == 2, "the page has the kind's file and one usage block"
    with _documented_kind() as namespace:
        assert NAME in list_attention_kinds()
        assert issubclass(namespace["ScaledHeadAttention"], AttentionLayer)
        assert "forward" not in vars(namespace["ScaledHeadAttention"])  # a kind writes no forward
        out = capsys.readouterr().out
        assert out.startswith("torch.Size([2, 7, 32]) torch.Size([2, 4, 7, 7]) ")
    assert NAME not in list_attention_kinds()
    with pytest.raises(RuntimeError, match="fails inside"), _documented_kind():
        raise RuntimeError("fails inside")  # a failing test unregisters it too
    assert NAME not in list_attention_kinds()


def test_every_hook_the_page_names_is_a_method_of_the_layer():
    text = PAGE.read_text(encoding="utf-8")
    table = text.split("## The hooks", 1)[1].split("Class attributes:", 1)[0]
    hooks = set(re.findall(r"^\| `(\w+)`(?:, `(\w+)`)? \|", table, flags=re.M))
    names = {n for pair in hooks for n in pair if n}
    assert {"project", "to_heads", "position_qk", "core", "write_cache", "cost", "aux_loss"} <= names
    missing = sorted(n for n in names - {"cost"} if not callable(getattr(AttentionLayer, n, None)))
    assert not missing, f"the page names hooks AttentionLayer lacks: {missing}"


@pytest.mark.parametrize("causal", [False, True])
def test_matches_the_reference_with_the_temperature_on_the_queries(kind, causal):
    """float64 cross-attention (S != T, kdim/vdim != C), GQA, padding: 1e-10 of the reference."""
    m = _build(num_kv_heads=2, kdim=7, vdim=9)
    assert isinstance(m, kind) and m.kind == NAME
    g = torch.Generator().manual_seed(1)
    B, T, S = 3, 5, 6
    x = torch.randn(B, T, 20, dtype=F64, generator=g)
    key = torch.randn(B, S, 7, dtype=F64, generator=g)
    value = torch.randn(B, S, 9, dtype=F64, generator=g)
    keep = torch.ones(B, S, dtype=torch.bool)
    keep[1, 4:] = False
    out, weights = m(x, key, value, key_mask=keep, is_causal=causal, return_weights=True)

    t = np.exp(_np(m.log_temperature))[None, :, None, None]  # (H,) -> (1, H, 1, 1)
    q = _heads(_linear(_np(x), m.q_proj), 4) * t
    k = _heads(_linear(_np(key), m.k_proj), 2)
    v = _heads(_linear(_np(value), m.v_proj), 2)
    ref_heads, ref_weights = reference_attention(
        q, k, v, mask=_np(keep)[:, None, None, :], is_causal=causal, scale=1 / np.sqrt(5), return_weights=True
    )
    merged = ref_heads.transpose(0, 2, 1, 3).reshape(B, T, 20)  # (B, H, T, D) -> (B, T, H*D)
    ref_out = _linear(merged, m.out_proj)
    scale = max(1.0, float(np.abs(ref_out).max()))
    np.testing.assert_allclose(_np(out), ref_out, rtol=0, atol=1e-10 * scale)
    np.testing.assert_allclose(_np(weights), ref_weights, rtol=0, atol=1e-10)


def test_at_its_initial_temperature_it_is_multi_head_attention_and_costs_as_much(kind):
    """exp(0) = 1: the kind with its initial log_temperature is MHA with the same weights."""
    torch.manual_seed(0)
    m = build_attention(NAME, embed_dim=20, num_heads=4, num_kv_heads=2, dtype=F64)
    mha = MultiHeadAttention(20, 4, num_kv_heads=2, dtype=F64)
    mha.load_state_dict({n: p for n, p in m.state_dict().items() if n != "log_temperature"})  # split layout loads
    x = torch.randn(2, 7, 20, dtype=F64)
    assert_paths_agree(m(x, is_causal=True), mha(x, is_causal=True))
    got, want = m.cost(7, causal=True), mha.cost(7, causal=True)
    assert (got.core_flops, got.projection_flops) == (want.core_flops, want.projection_flops)
    assert got.kv_cache_bytes_per_token == want.kv_cache_bytes_per_token
    assert got.parameters == want.parameters + 4  # the H temperatures
    assert m.cost(7).parameters == sum(p.numel() for p in m.parameters())


def test_cached_decoding_equals_full_recomputation_with_rope_and_qk_norm(kind):
    m = _build(num_kv_heads=2, rope={"rotary_dim": 4}, qk_norm=True).eval()
    x = torch.randn(2, 9, 20, dtype=F64)
    full = m(x, is_causal=True)
    cache = m.make_kv_cache(2, 9)
    assert tuple(cache.k.shape) == (2, 2, 9, 5)  # sized by G key/value heads
    steps = [m(x[:, :4], is_causal=True, kv_cache=cache)]
    steps += [m(x[:, 4:6], is_causal=True, kv_cache=cache)]
    steps += [m(x[:, t : t + 1], is_causal=True, kv_cache=cache) for t in range(6, 9)]
    assert cache.length == 9
    assert_paths_agree(torch.cat(steps, dim=1), full)


def test_cross_attention_cache_is_filled_once_and_reused(kind):
    m = _build(rope={"rotary_dim": 4}).eval()  # D = 5: rotate 4 channels
    memory = torch.randn(2, 6, 20, dtype=F64)
    y = torch.randn(2, 4, 20, dtype=F64)
    cache = m.make_kv_cache(2, 6)
    first = m(y[:, :2], memory, memory, kv_cache=cache)
    assert cache.length == 6
    second = m(y[:, 2:], memory, memory, kv_cache=cache)
    assert cache.length == 6  # reused, not appended
    assert_paths_agree(first, m(y[:, :2], memory, memory))
    # rope: the queries of every call sit at 0 .. T-1 unless positions says otherwise
    assert_paths_agree(second, m(y[:, 2:], memory, memory))
    with pytest.raises(ValueError, match="another key tensor"):
        m(y, memory.clone(), kv_cache=cache)
    with pytest.raises(ValueError, match="holds cross-attention keys"):
        m(y, kv_cache=cache)  # a self-attention call on it
    assert cache.length == 6


def test_observers_see_the_weights_and_the_scores_q_and_k(kind):
    m = _build(num_kv_heads=2)
    events = []
    handle = m.register_attention_observer(lambda module, event: events.append((module, event)))
    x = torch.randn(2, 5, 20, dtype=F64)
    _, weights = m(x, is_causal=True, return_weights=True)
    m(x)  # observed without return_weights: the layer asks its core for them
    handle.remove()
    m(x)
    assert len(events) == 2 and all(module is m for module, _ in events)
    event = events[0][1]
    assert event.kind == NAME and event.is_causal
    assert torch.equal(event.weights, weights)  # the very tensor the call returned, detached
    # event.scale * q . k rebuilds the scores the softmax saw: the temperature is in event.q
    k = event.k.repeat_interleave(2, dim=1)  # (B, G, S, D) -> (B, H, S, D)
    scores = event.scale * event.q @ k.transpose(-1, -2)
    hidden = ~torch.ones(5, 5, dtype=torch.bool).tril()
    rebuilt = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    assert_paths_agree(rebuilt, weights)
    plain = reference_attention(_np(event.q), _np(event.k), _np(event.k), scale=event.scale, return_weights=True)[1]
    np.testing.assert_allclose(_np(events[1][1].weights), plain, rtol=0, atol=1e-10)  # the call without a mask


def test_the_temperature_learns_and_there_is_no_loss_term(kind):
    """A gradient reaches every log_temperature through the scores; aux_loss() is the default zero."""
    m = _build()
    m(torch.randn(2, 5, 20, dtype=F64), is_causal=True).square().sum().backward()
    grad = m.log_temperature.grad
    assert grad is not None and torch.isfinite(grad).all() and bool((grad != 0).all())
    assert m.aux_loss().shape == () and float(m.aux_loss()) == 0.0 and m.aux_loss().dtype == F64


def test_models_take_the_kind_by_name_and_decode_with_their_caches(kind):
    """GPT (self-attention cache) and the encoder-decoder (cross-attention cache too)."""
    from support.paths import assert_cached_generation_agrees, assert_greedy_agrees

    from multihead.models import GPT, GPTConfig, Transformer, TransformerConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_preset("tiny", attention=NAME, num_layers=1, num_kv_heads=2)).eval()
    assert all(isinstance(block.attn, kind) for block in gpt.blocks)
    assert_cached_generation_agrees(gpt, torch.tensor([list(b"kind")]), 5)
    model = Transformer(TransformerConfig.from_preset(
        "copy-task", attention=NAME, num_encoder_layers=1, num_decoder_layers=1)).eval()  # fmt: skip
    src = torch.tensor([[3, 4, 5, 6, 2], [7, 8, 2, 0, 0]])
    with torch.no_grad():
        tokens, logits = model.greedy_decode(src, 6, return_logits=True)
        ref, ref_logits = model.greedy_decode(src, 6, use_cache=False, return_logits=True)
    assert_greedy_agrees(tokens, ref, logits, ref_logits, start=1)


def test_its_capabilities_select_heads_and_the_comparison_need_no_other_edit(kind):
    """select_heads equals masking (temperatures travel with their heads), prune keeps
    the model's function, and ``multihead compare``'s default list takes the kind."""
    from multihead.models import GPT, GPTConfig
    from multihead.tools import mask_heads, prune_heads
    from multihead.train.compare_plan import default_kinds, plan_kind

    m = _build(num_kv_heads=2)  # q0 q1 | q2 q3
    x = torch.randn(2, 5, 20, dtype=F64)
    small = m.select_heads([2, 3])
    assert (small.num_heads, small.num_kv_heads) == (2, 1)
    assert torch.equal(small.log_temperature, m.log_temperature[2:])  # a copy: same values
    with mask_heads(m, {0: [0, 1]}):
        assert_paths_agree(small(x, is_causal=True), m(x, is_causal=True))
    assert NAME in default_kinds() and plan_kind(GPTConfig.from_preset("mini"), NAME).attention_options == {
        "num_kv_heads": 2
    }
    torch.manual_seed(0)
    gpt = GPT(GPTConfig.from_preset("tiny", attention=NAME, num_layers=2, num_kv_heads=2)).eval()
    idx = torch.tensor([list(b"heads")])
    with mask_heads(gpt, {1: [1, 3]}):
        want = gpt(idx)
    prune_heads(gpt, {1: [1, 3]})
    assert gpt.config.layer_heads == [4, 2]
    assert_paths_agree(gpt(idx), want)
