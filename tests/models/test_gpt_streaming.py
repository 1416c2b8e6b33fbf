"""``GPTConfig.positions`` and streaming generation past the context
(``GPT.generate(streaming=(k, w))``, StreamingLLM): every step's logits equal
a recomputation over exactly the tokens the caches keep, at their cache slots,
in memory that does not grow."""

from __future__ import annotations

import pytest
import torch

from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.streaming_cache import StreamingKVCache, streaming_cache


def tiny(positions: str, num_layers: int = 1, context_length: int = 16, **extra) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=40, context_length=context_length, embed_dim=32, num_layers=num_layers,
                       num_heads=4, positions=positions, **extra)  # fmt: skip
    return GPT(config).double().eval()


def kept(p: int, sinks: int, window: int) -> list[int]:
    """The positions a query at p sees through the caches: the sinks and the last ``window``."""
    return sorted(set(range(min(sinks, p + 1))) | set(range(max(0, p - window + 1), p + 1)))


def recomputed(model: GPT, tokens: torch.Tensor, T0: int, sinks: int, window: int) -> torch.Tensor:
    """[B, n, V]: the logits of every step, recomputed token by token from the model's
    modules. Each block's query attends over the block inputs of exactly the kept
    tokens, fed to the attention without a cache (so at positions 0 .. m - 1)."""
    inputs: list[list[torch.Tensor]] = [[] for _ in model.blocks]  # block l's input of each token, [B, C]
    out = []
    with torch.no_grad():
        for p in range(tokens.shape[1] - 1):
            x = model.token_embedding(tokens[:, p])  # (B, C)
            for layer, block in enumerate(model.blocks):
                inputs[layer].append(x)
                seq = torch.stack([inputs[layer][j] for j in kept(p, sinks, window)], dim=1)  # (B, m, C)
                x = x + block.attn(block.ln_1(seq), is_causal=True)[:, -1]
                x = x + block.mlp(block.ln_2(x))
            if p >= T0 - 1:
                out.append(model.lm_head(model.ln_f(x)))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("positions", ["rope", "alibi", "none"])
@pytest.mark.parametrize("T0", [3, 9])  # a prompt within sinks + window, and one longer (fed on token by token)
def test_each_step_equals_a_forward_over_the_kept_tokens_at_their_slots(positions, T0):
    model, sinks, window = tiny(positions), 2, 5
    prompt = torch.randint(0, 40, (2, T0), generator=torch.Generator().manual_seed(1))
    n = 3 * model.config.context_length
    tokens, logits = model.generate(prompt, n, temperature=0, streaming=(sinks, window), return_logits=True)
    assert tokens.shape == (2, T0 + n) and logits.shape == (2, n, 40)
    with torch.no_grad():
        for s in range(n):
            p = T0 - 1 + s  # the query of step s
            full = model(tokens[:, kept(p, sinks, window)])[:, -1]  # positions 0 .. m - 1, no cache
            torch.testing.assert_close(logits[:, s], full, rtol=1e-9, atol=1e-9)


def test_a_deep_model_with_local_and_global_layers_equals_the_token_by_token_recomputation():
    model = tiny("rope", num_layers=3, layer_attention_options=[{"window": 3}, {}])
    sinks, window, T0 = 2, 6, 10
    prompt = torch.randint(0, 40, (1, T0), generator=torch.Generator().manual_seed(2))
    tokens, logits = model.generate(prompt, 40, temperature=0, streaming=(sinks, window), return_logits=True)
    torch.testing.assert_close(logits, recomputed(model, tokens, T0, sinks, window), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("kind", "options"), [
    ("mha", {"rope": True}),
    ("gqa", {"num_kv_heads": 2, "rope": {"rotary_dim": 4}, "qk_norm": True}),
    ("collaborative", {"rope": True, "qk_norm": True}),
])  # fmt: skip
def test_a_layer_with_a_cache_slot_streaming_cache_attends_as_over_the_kept_inputs(kind, options):
    """Rope (and qk_norm) after the write: the same as the layer over the kept inputs
    alone, where the rule of original positions is another computation."""
    from multihead import build_attention

    torch.manual_seed(3)
    attn = build_attention(kind, embed_dim=32, num_heads=4, **options).double().eval()
    sinks, window = 2, 5
    x = torch.randn(1, 30, 32, dtype=torch.float64)
    outs = {}
    for rule in ("cache", "original"):
        cache = streaming_cache(attn, 1, sink_tokens=sinks, window=window, max_step=1, positions=rule)
        outs[rule] = torch.cat([attn(x[:, p : p + 1], is_causal=True, kv_cache=cache) for p in range(30)], dim=1)
    slot = torch.stack([attn(x[:, kept(p, sinks, window)], is_causal=True)[:, -1] for p in range(30)], dim=1)
    torch.testing.assert_close(outs["cache"], slot, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(outs["original"][:, 10:], slot[:, 10:], atol=1e-6)


def test_a_cache_slot_streaming_cache_refuses_positions_and_unknown_rules():
    from multihead import build_attention

    attn = build_attention("mha", embed_dim=16, num_heads=2, rope=True)
    cache = streaming_cache(attn, 1, sink_tokens=1, window=3, max_step=1, positions="cache")
    with pytest.raises(ValueError, match="positions cannot be given with a streaming cache of positions='cache'"):
        attn(torch.randn(1, 1, 16), is_causal=True, kv_cache=cache, positions=torch.tensor([5]))
    assert cache.length == 0
    with pytest.raises(ValueError, match=r"positions must be one of \['original', 'cache'\], got positions='slots'"):
        streaming_cache(attn, 1, sink_tokens=1, window=3, max_step=1, positions="slots")


def test_memory_stays_bounded_while_generating_three_times_the_context(monkeypatch):
    model, sinks, window, T0 = tiny("rope", num_layers=2), 4, 8, 5
    made: list[StreamingKVCache] = []
    make = GPT.make_streaming_caches

    def spy(self, *args, **kwargs):
        made.extend(make(self, *args, **kwargs))
        at_first.extend((c.k.data_ptr(), c.v.data_ptr()) for c in made)
        return made

    at_first: list[tuple[int, int]] = []

    monkeypatch.setattr(GPT, "make_streaming_caches", spy)
    n = 3 * model.config.context_length
    prompt = torch.randint(0, 40, (1, T0))
    tokens = model.generate(prompt, n, temperature=0, streaming=(sinks, window))
    assert tokens.shape[1] == T0 + n > 3 * model.config.context_length
    assert len(made) == 2
    for cache in made:
        assert cache.length == T0 + n - 1  # every token seen but the last, which no step fed
        assert tuple(cache.k.shape) == (1, 4, sinks + window - 1 + T0, 8)  # fixed when built
        assert cache.key_positions().tolist() == kept(T0 + n - 2, sinks, window)
    assert at_first == [(c.k.data_ptr(), c.v.data_ptr()) for c in made]  # the same buffers throughout


def test_a_learned_position_table_is_refused_in_one_line_before_any_forward():
    model = tiny("learned")
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError) as err:
        model.generate(torch.zeros(1, 3, dtype=torch.long), 40, streaming=(2, 5))
    message = str(err.value)
    assert "\n" not in message and "learned position table" in message and "context_length=16" in message
    assert calls == []
    with pytest.raises(ValueError, match="learned position table"):
        model.make_streaming_caches(1, sink_tokens=1, window=4, max_step=1)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"streaming": (2, 15)}, ValueError, r"sink_tokens \+ window = 2 \+ 15 = 17 positions, more than.*context_length=16"),
    ({"streaming": (2,)}, TypeError, r"pair \(sink_tokens, window\), got streaming=\(2,\)"),
    ({"streaming": (-1, 4)}, ValueError, "sink_tokens"),
    ({"streaming": (1, 4), "use_cache": False}, ValueError, "use_cache=False"),
    ({"streaming": (1, 4), "attention_mask": torch.tensor([[0, 1, 1]])}, ValueError, "padded attention_mask"),
])  # fmt: skip
def test_streaming_refusals(kwargs, error, match):
    with pytest.raises(error, match=match):
        tiny("rope").generate(torch.zeros(1, 3, dtype=torch.long), 4, **kwargs)


def test_a_forward_over_streaming_caches_takes_no_mask():
    model = tiny("alibi")
    caches = model.make_streaming_caches(1, sink_tokens=1, window=4, max_step=2)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        model(torch.zeros(1, 2, dtype=torch.long), kv_caches=caches, attention_mask=torch.ones(1, 2))
    assert all(c.length == 0 for c in caches)


# ---------------------------------------------------------------------- the positions field
def test_positions_choose_the_table_or_the_attention_option():
    learned, rope, alibi, none = (tiny(p) for p in ("learned", "rope", "alibi", "none"))
    assert learned.position_embedding is not None and learned.blocks[0].attn.rope is None
    for model in (rope, alibi, none):
        assert model.position_embedding is None
        assert "position_embedding.weight" not in model.state_dict()
    assert rope.blocks[0].attn.rope is not None and rope.blocks[0].attn.alibi_slopes is None
    assert alibi.blocks[0].attn.alibi_slopes is not None and alibi.blocks[0].attn.rope is None
    assert none.blocks[0].attn.rope is None and none.blocks[0].attn.alibi_slopes is None
    assert learned.num_parameters() - none.num_parameters() == 16 * 32
    # a layer's own options win: a layer without rope among rope layers
    mixed = tiny("rope", num_layers=2, layer_attention_options=[{}, {"rope": False}])
    assert mixed.blocks[0].attn.rope is not None and mixed.blocks[1].attn.rope is None


def test_positions_round_trip_and_learned_is_left_out_of_the_dict():
    config = tiny("alibi").config
    assert config.to_dict()["positions"] == "alibi"
    assert GPTConfig.from_dict(config.to_dict()) == config
    assert "positions" not in tiny("learned").config.to_dict()
    with pytest.raises(ValueError, match=r"positions must be one of \['learned', 'rope', 'alibi', 'none'\], got positions='abs'"):
        GPTConfig(vocab_size=8, context_length=8, embed_dim=8, num_layers=1, num_heads=2, positions="abs")


@pytest.mark.parametrize("positions", ["rope", "alibi"])
def test_checkpoints_keep_positions(tmp_path, positions):
    from multihead.models.checkpoint import load_checkpoint, save_checkpoint

    model = tiny(positions, num_layers=2, layer_attention_options=[{"window": 4}, {}])
    save_checkpoint(model, tmp_path / "ckpt")
    loaded = load_checkpoint(tmp_path / "ckpt").double().eval()
    assert loaded.config == model.config
    idx = torch.randint(0, 40, (1, 12))
    torch.testing.assert_close(loaded(idx), model(idx))


def test_gpt2_export_refuses_a_model_without_the_table():
    from multihead.hf.export import check_hf_export

    model = tiny("rope")
    with pytest.raises(ValueError, match=r"learned position table \(wpe\); got positions='rope'"):
        model.config.to_hf_config()
    with pytest.raises(ValueError, match=r"learned absolute position table \(wpe\); this model's positions='rope'"):
        check_hf_export(model)
