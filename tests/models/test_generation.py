"""Generation: cached decoding vs Hugging Face and vs recomputation, padding,
eos, sampling filters and argument checks.

Tolerances: float32 logits use torch.testing defaults; the batched-vs-alone
comparisons run in float64 and match to 1e-10.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multihead.models.generation import filter_top_k, filter_top_p, generate, sample_next_token
from multihead.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")
from support.hf_gpt2 import hf_model, ours_from  # noqa: E402
from support.paths import assert_greedy_agrees  # noqa: E402
from support.properties import examples  # noqa: E402


@pytest.fixture(scope="module")
def pair():
    hf = hf_model()
    return hf, ours_from(hf)


def small_model(seed=0, dtype=torch.float32, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig.from_preset("tiny", **{"context_length": 48, "vocab_size": 61, **overrides})
    return GPT(cfg, dtype=dtype).eval()


def left_pad(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad 1-D prompts into idx [B, T0] and attention_mask [B, T0]."""
    T0 = max(len(r) for r in rows)
    idx = torch.full((len(rows), T0), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), T0, dtype=torch.long)
    for i, r in enumerate(rows):
        idx[i, T0 - len(r) :] = r
        mask[i, T0 - len(r) :] = 1
    return idx, mask


def hf_greedy(hf, idx, n, mask=None):
    out = hf.generate(
        idx,
        attention_mask=torch.ones_like(idx) if mask is None else mask,
        do_sample=False,
        use_cache=True,
        max_new_tokens=n,
        min_new_tokens=n,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences, torch.stack(out.logits, dim=1)


# ------------------------------------------------------------------ parity
def test_cached_greedy_matches_hf_and_recomputation(pair):
    hf, ours = pair
    idx = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    want_tokens, want_logits = hf_greedy(hf, idx, 12)
    tokens, logits = ours.generate(idx, 12, temperature=0, return_logits=True)
    ref_tokens, ref_logits = ours.generate(idx, 12, temperature=0, return_logits=True, use_cache=False)
    assert tokens.shape == (2, 19) and logits.shape == (2, 12, 97)
    assert_greedy_agrees(tokens, want_tokens, logits, want_logits, start=7)
    assert_greedy_agrees(tokens, ref_tokens, logits, ref_logits, start=7)


def test_left_padded_batch_matches_hf(pair):
    hf, ours = pair
    g = torch.Generator().manual_seed(2)
    idx, mask = left_pad([torch.randint(1, 97, (n,), generator=g) for n in (8, 3, 5)])
    want_tokens, want_logits = hf_greedy(hf, idx, 10, mask)
    tokens, logits = ours.generate(idx, 10, temperature=0, attention_mask=mask, return_logits=True)
    assert_greedy_agrees(tokens, want_tokens, logits, want_logits, start=idx.shape[1])


@pytest.mark.parametrize("kind,kv", [("mha", None), ("gqa", 2), ("mqa", None)])
def test_batched_left_padding_equals_each_row_alone(kind, kv):
    model = small_model(seed=1, dtype=torch.float64, attention=kind, num_kv_heads=kv)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(1, 61, (n,), generator=g) for n in (6, 1, 4)]
    idx, mask = left_pad(rows)
    for use_cache in (True, False):
        tokens, logits = model.generate(
            idx, 9, temperature=0, attention_mask=mask, return_logits=True, use_cache=use_cache
        )
        for i, r in enumerate(rows):
            alone_tokens, alone_logits = model.generate(r[None], 9, temperature=0, return_logits=True)
            assert torch.equal(tokens[i, idx.shape[1] - len(r) :], alone_tokens[0])
            assert (logits[i] - alone_logits[0]).abs().max() < 1e-10


@pytest.mark.parametrize("kind,kv", [("gqa", 2), ("mqa", None)])
def test_cached_equals_uncached_for_grouped_heads(kind, kv):
    model = small_model(seed=2, attention=kind, num_kv_heads=kv)
    idx = torch.randint(0, 61, (3, 5), generator=torch.Generator().manual_seed(4))
    a_tokens, a_logits = model.generate(idx, 15, temperature=0, return_logits=True)
    b_tokens, b_logits = model.generate(idx, 15, temperature=0, return_logits=True, use_cache=False)
    assert_greedy_agrees(a_tokens, b_tokens, a_logits, b_logits, start=5)
    # sampled too: same generator seed, same tokens (a draw within float rounding of a
    # cumulative-probability boundary, about 1e-6 per token, would flip one)
    a = model.generate(idx, 15, top_k=10, generator=torch.Generator().manual_seed(0))
    b = model.generate(idx, 15, top_k=10, generator=torch.Generator().manual_seed(0), use_cache=False)
    assert torch.equal(a, b)


def test_kv_caches_are_sized_by_kv_heads():
    model = small_model(attention="gqa", num_kv_heads=2)
    caches = model.make_kv_caches(3, 20)
    assert len(caches) == 2 and tuple(caches[0].k.shape) == (3, 2, 20, 16)


# ------------------------------------------------------------------ eos
def test_eos_rows_keep_emitting_eos_and_the_loop_stops():
    model = small_model(seed=5)
    idx = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(6))
    free = model.generate(idx, 12, temperature=0)
    eos = int(free[0, 4 + 2])  # the token row 0 emits at step 2
    tokens, logits = model.generate(idx, 12, temperature=0, eos=eos, return_logits=True)
    first = [next((s for s in range(12) if free[r, 4 + s] == eos), None) for r in range(2)]
    assert first[0] <= 2
    for r in range(2):
        if first[r] is not None:
            assert torch.equal(tokens[r, 4 : 5 + first[r]], free[r, 4 : 5 + first[r]])
            assert (tokens[r, 5 + first[r] :] == eos).all()
    stop = max(s for s in first) if None not in first else 12 - 1
    assert tokens.shape[1] == 4 + stop + 1 and logits.shape[1] == stop + 1
    # a distinct pad fills the finished rows instead
    padded = model.generate(idx, 12, temperature=0, eos=eos, pad=60)
    r0 = first[0]
    assert padded[0, 4 + r0] == eos and (padded[0, 5 + r0 :] == 60).all()


def test_generation_stops_early_when_every_row_is_done():
    model = small_model(seed=5)
    idx = torch.randint(0, 61, (1, 4), generator=torch.Generator().manual_seed(7))
    eos = int(model.generate(idx, 1, temperature=0)[0, -1])
    tokens = model.generate(idx, 20, temperature=0, eos=eos)
    assert tokens.shape == (1, 5) and tokens[0, -1] == eos


# ------------------------------------------------------------------ sampling
def test_top_k_one_equals_greedy():
    model = small_model(seed=8)
    idx = torch.randint(0, 61, (2, 3), generator=torch.Generator().manual_seed(8))
    greedy = model.generate(idx, 10, temperature=0)
    assert torch.equal(model.generate(idx, 10, top_k=1, generator=torch.Generator().manual_seed(1)), greedy)
    assert torch.equal(model.generate(idx, 10, top_p=1e-6, generator=torch.Generator().manual_seed(1)), greedy)


def test_seeded_sampling_is_reproducible():
    model = small_model(seed=9)
    idx = torch.zeros(2, 1, dtype=torch.long)

    def draw(seed):
        return model.generate(idx, 30, temperature=1.5, top_p=0.95, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(0), draw(0))
    assert not torch.equal(draw(0), draw(1))


def test_filter_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    out = filter_top_k(logits, 2)
    assert torch.equal(torch.isfinite(out), torch.tensor([[False, True, False, True, False]]))
    assert torch.equal(out[torch.isfinite(out)], torch.tensor([5.0, 4.0]))
    assert torch.equal(filter_top_k(logits, 9), logits)


def test_filter_top_p_keeps_the_smallest_set_with_mass_at_least_p():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(filter_top_p(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.4) == [False, True, False, False]  # 0.5 >= 0.4
    assert kept(0.6) == [False, True, False, True]  # 0.5 + 0.3
    assert kept(0.85) == [False, True, True, True]  # 0.5 + 0.3 + 0.15 = 0.95
    assert kept(0.99) == [True, True, True, True]
    assert kept(1.0) == [True, True, True, True]
    # the kept logits are unchanged
    out = filter_top_p(logits, 0.6)
    assert torch.equal(out[torch.isfinite(out)], logits[0, [1, 3]])


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(st.floats(-5, 5, allow_nan=False), min_size=1, max_size=12),
    st.floats(0.01, 1.0),
)
def test_filter_top_p_property(values, p):
    logits = torch.tensor([values], dtype=torch.float64)
    probs = torch.softmax(logits, -1)[0]
    keep = torch.isfinite(filter_top_p(logits, p))[0]
    kept_mass = probs[keep].sum().item()
    dropped_max = probs[~keep].max().item() if (~keep).any() else 0.0
    # every kept token is at least as likely as every dropped one
    assert probs[keep].min().item() >= dropped_max
    # mass >= p, and no smaller set reaches p: removing the least likely kept token falls below p
    assert kept_mass >= p - 1e-12
    if keep.sum() > 1:
        assert kept_mass - probs[keep].min().item() < p + 1e-12


def test_sample_next_token_greedy_and_checks():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    assert sample_next_token(logits, temperature=0).tolist() == [1, 0]
    with pytest.raises(ValueError, match="temperature=-1"):
        sample_next_token(logits, temperature=-1)
    with pytest.raises(ValueError, match="top_p=0"):
        filter_top_p(logits, 0)
    with pytest.raises(ValueError, match="top_k=0"):
        filter_top_k(logits, 0)


# ------------------------------------------------------------------ argument checks
def test_prompt_longer_than_the_context_raises_before_any_work():
    model = small_model()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    model.make_kv_caches = lambda *a: calls.append("cache")  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="prompt length 49 exceeds context_length=48"):
        model.generate(torch.zeros(1, 49, dtype=torch.long), 1)
    assert calls == []


def test_generation_past_the_context_slides_the_window():
    """Past context_length each step sees the last 16 tokens; cached and uncached
    decoding agree, and both follow a plain loop that crops the sequence."""
    model = small_model(seed=3, context_length=16)
    prompt = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(0))
    tokens, logits = model.generate(prompt, 30, temperature=0, return_logits=True)
    tokens_ref, logits_ref = model.generate(prompt, 30, temperature=0, use_cache=False, return_logits=True)
    assert tokens.shape == (2, 40)
    assert_greedy_agrees(tokens, tokens_ref, logits, logits_ref, start=prompt.shape[1])
    crop, steps = prompt, []
    with torch.no_grad():
        for _ in range(30):
            step = model(crop[:, -16:])[:, -1]  # the model never sees more than its context
            steps.append(step)
            crop = torch.cat([crop, step.argmax(-1, keepdim=True)], dim=1)
    assert_greedy_agrees(tokens_ref, crop, logits_ref, torch.stack(steps, dim=1), start=prompt.shape[1])


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]])), ValueError, r"left padding.*rows \[0\]"),
        (dict(attention_mask=torch.ones(2, 4)), ValueError, r"\(B, T0\) = \(2, 3\), got \(2, 4\)"),
        (dict(eos=61), ValueError, r"eos=61"),
        (dict(top_k=0), ValueError, "top_k=0"),
        (dict(top_p=1.5), ValueError, "top_p=1.5"),
        (dict(temperature=float("nan")), ValueError, "temperature=nan"),
    ],
)
def test_generate_argument_errors(kwargs, exc, match):
    model = small_model()
    with pytest.raises(exc, match=match):
        model.generate(torch.zeros(2, 3, dtype=torch.long), 4, **kwargs)


def test_zero_new_tokens_and_full_mask():
    model = small_model()
    idx = torch.randint(0, 61, (2, 3))
    assert torch.equal(model.generate(idx, 0), idx)
    a = model.generate(idx, 5, temperature=0)
    b = generate(model, idx, 5, temperature=0, attention_mask=torch.ones(2, 3, dtype=torch.bool))
    assert torch.equal(a, b)
