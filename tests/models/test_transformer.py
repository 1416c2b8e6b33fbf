"""Tests for multihead.models.transformer: the encoder-decoder of "Attention Is All You Need"."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F
from support.paths import assert_greedy_agrees

from multihead.models.copy_task import CopyBatch, copy_task_batches
from multihead.models.transformer import PRESETS, Transformer, TransformerConfig

V, L = 11, 10  # copy-task vocabulary and longest sequence
STEPS, BATCH, LR, WARMUP = 400, 32, 3e-3, 50


def small(**overrides) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig.from_preset("copy-task", **overrides)).eval()


def padded_batch(seed: int = 0, batch: int = 4) -> CopyBatch:
    return next(copy_task_batches(1, batch, L, V, min_len=3, generator=torch.Generator().manual_seed(seed)))


def same_rows(a: torch.Tensor, b: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """Row-wise equality of two [B, *] token tensors after right-padding to one width."""
    width = max(a.shape[1], b.shape[1])
    a, b = (F.pad(x, (0, width - x.shape[1]), value=pad) for x in (a, b))
    return (a == b).all(dim=1)


@pytest.fixture(scope="module")
def trained():
    """The copy-task preset trained on the synthetic copy task (seeded, Adam, fixed budget)."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig.from_preset("copy-task"))
    opt = torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.98), eps=1e-9, foreach=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min((i + 1) / WARMUP, 0.5 * (1 + math.cos(math.pi * i / STEPS)))
    )
    start = time.perf_counter()
    for b in copy_task_batches(STEPS, BATCH, L, V, min_len=5, generator=torch.Generator().manual_seed(0)):
        logits = model(b.src, b.tgt[:, :-1], src_key_mask=b.src_key_mask)  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, V), b.tgt[:, 1:].reshape(-1), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
    seconds = time.perf_counter() - start
    held_out = next(copy_task_batches(1, 128, L, V, min_len=5, generator=torch.Generator().manual_seed(1234)))
    return model.eval(), held_out, seconds


# ----------------------------------------------------------------- copy task
def test_copy_task_training_copies_held_out_sequences_exactly(trained):
    model, b, seconds = trained
    max_len = L + 5
    out = model.greedy_decode(b.src, max_len, src_key_mask=b.src_key_mask)
    # every row stopped at eos, so decoding ended at the longest row (bos + L + eos), not max_len
    assert out.shape == (128, b.tgt.shape[1])
    accuracy = same_rows(out, b.tgt).float().mean().item()
    assert accuracy == 1.0, f"exact-copy accuracy {accuracy} after {STEPS} steps ({seconds:.1f} s)"


def test_cached_and_uncached_greedy_decoding_agree(trained):
    model, b, _ = trained
    kw = {"src_key_mask": b.src_key_mask, "return_logits": True}
    tokens, logits = model.greedy_decode(b.src, L + 5, use_cache=True, **kw)
    tokens_ref, logits_ref = model.greedy_decode(b.src, L + 5, use_cache=False, **kw)
    assert logits.shape == (128, tokens.shape[1] - 1, V)
    assert_greedy_agrees(tokens, tokens_ref, logits, logits_ref, start=1)
    # after eos a finished row is padded
    ended = (tokens == 2).int().cumsum(1).roll(1, 1).clamp(max=1).bool()
    ended[:, 0] = False
    assert (tokens[ended] == 0).all()


def test_cross_attention_is_diagonal_in_some_head_after_training(trained):
    model, b, _ = trained
    weights = model.cross_attention_weights(b.src, b.tgt[:, :-1], src_key_mask=b.src_key_mask)
    B, S, T = b.src.shape[0], b.src.shape[1], b.tgt.shape[1] - 1
    assert len(weights) == 2 and all(w.shape == (B, 4, T, S) for w in weights)
    # decoder position t predicts src token t: does it look at source position t?
    real = b.tgt_key_mask[:, 1:]  # (B, T): positions whose next token is real
    diagonal = torch.arange(T).clamp(max=S - 1)
    best = max(
        (((w.argmax(-1) == diagonal) & real[:, None]).sum((0, 2)).float() / real.sum()).max().item()
        for w in weights
    )
    assert best >= 0.8, f"best head matches the diagonal argmax on only {best:.2f} of positions"


# ------------------------------------------------------------------- masks
def test_source_tokens_at_padded_positions_do_not_change_outputs():
    model, b = small(), padded_batch()
    pad = ~b.src_key_mask
    assert pad.any()
    other = b.src.masked_fill(pad, 7)
    memory = model.encode(b.src, b.src_key_mask)
    memory2 = model.encode(other, b.src_key_mask)
    torch.testing.assert_close(memory[b.src_key_mask], memory2[b.src_key_mask])
    logits = model(b.src, b.tgt, src_key_mask=b.src_key_mask)
    torch.testing.assert_close(model(other, b.tgt, src_key_mask=b.src_key_mask), logits)


def test_decoder_position_t_does_not_see_later_target_tokens():
    model, b = small(), padded_batch()
    logits = model(b.src, b.tgt, src_key_mask=b.src_key_mask)
    for t in (0, 3, 7):
        changed = b.tgt.clone()
        changed[:, t + 1 :] = torch.randint(3, V, changed[:, t + 1 :].shape, generator=torch.Generator().manual_seed(t))
        new = model(b.src, changed, src_key_mask=b.src_key_mask)
        torch.testing.assert_close(new[:, : t + 1], logits[:, : t + 1])
        assert not torch.allclose(new[:, t + 1 :], logits[:, t + 1 :])


def test_cross_attention_gives_padded_source_positions_zero_weight():
    model, b = small(), padded_batch()
    logits, weights = model(b.src, b.tgt, src_key_mask=b.src_key_mask, return_cross_weights=True)
    assert logits.shape == (4, b.tgt.shape[1], V) and len(weights) == 2
    for w in weights:
        assert w.shape == (4, 4, b.tgt.shape[1], b.src.shape[1])
        assert (w.masked_select(~b.src_key_mask[:, None, None, :]) == 0).all()
        torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))


def test_target_padding_mask_hides_padded_target_keys():
    model, b = small(), padded_batch()
    # left-pad the target by one position: with the mask, real positions ignore it
    tgt = F.pad(b.tgt, (1, 0), value=0)
    mask = F.pad(b.tgt_key_mask, (1, 0), value=False)
    a = model(b.src, tgt, src_key_mask=b.src_key_mask, tgt_key_mask=mask)
    tgt[:, 0] = 5
    c = model(b.src, tgt, src_key_mask=b.src_key_mask, tgt_key_mask=mask)
    torch.testing.assert_close(a[:, 1:], c[:, 1:])


# ------------------------------------------------------------- decoding
def test_incremental_decode_with_caches_matches_full_decode():
    model, b = small(), padded_batch()
    memory = model.encode(b.src, b.src_key_mask)
    full = model.decode(b.tgt, memory, src_key_mask=b.src_key_mask)
    caches = model.make_kv_caches(4, b.tgt.shape[1])
    parts = [model.decode(b.tgt[:, :5], memory, src_key_mask=b.src_key_mask, kv_caches=caches)]
    for t in range(5, b.tgt.shape[1]):
        parts.append(model.decode(b.tgt[:, t : t + 1], memory, src_key_mask=b.src_key_mask, kv_caches=caches))
    assert caches.length == b.tgt.shape[1]
    # each layer's cross-attention cache holds the memory's keys, filled once and reused
    assert [c.length for c in caches.cross] == [memory.shape[1]] * len(model.decoder)
    torch.testing.assert_close(torch.cat(parts, dim=1), full)
    with pytest.raises(ValueError, match="another memory"):
        model.decode(b.tgt[:, :1], memory.clone(), kv_caches=caches)
    caches.reset()
    assert caches.length == 0 and caches.memory is None


def test_observed_cross_attention_is_called_on_every_cached_step():
    model, b = small(), padded_batch()
    events = []
    handle = model.decoder[0].cross_attn.register_attention_observer(lambda m, e: events.append(e.weights.shape))
    try:
        tokens, logits = model.greedy_decode(b.src, 6, src_key_mask=b.src_key_mask, return_logits=True)
    finally:
        handle.remove()
    assert events == [(4, 4, 1, b.src.shape[1])] * (tokens.shape[1] - 1)
    tokens_ref, logits_ref = model.greedy_decode(b.src, 6, src_key_mask=b.src_key_mask, return_logits=True)
    assert_greedy_agrees(tokens, tokens_ref, logits, logits_ref, start=1)


def test_greedy_decode_with_max_len_one_returns_bos():
    model, b = small(), padded_batch()
    tokens, logits = model.greedy_decode(b.src, 1, return_logits=True)
    assert tokens.tolist() == [[1]] * 4 and logits.shape == (4, 0, V)


# -------------------------------------------------------- variants, config
@pytest.mark.parametrize(("kind", "num_kv_heads", "groups"), [("gqa", 2, 2), ("mqa", None, 1), ("mha", None, 4)])
def test_attention_kinds_build_and_decode(kind, num_kv_heads, groups):
    model, b = small(attention=kind, num_kv_heads=num_kv_heads), padded_batch()
    assert all(layer.cross_attn.num_kv_heads == groups for layer in model.decoder)
    logits = model(b.src, b.tgt, src_key_mask=b.src_key_mask)
    assert logits.shape == (4, b.tgt.shape[1], V) and torch.isfinite(logits).all()
    kw = {"src_key_mask": b.src_key_mask, "return_logits": True}
    tokens, lg = model.greedy_decode(b.src, 8, **kw)
    tokens_ref, lg_ref = model.greedy_decode(b.src, 8, use_cache=False, **kw)
    assert_greedy_agrees(tokens, tokens_ref, lg, lg_ref, start=1)


@pytest.mark.parametrize(("kind", "options", "read"), [
    ("overlapping", {"overlap": 2}, lambda layer: layer.overlap == 2),
    ("mha", {"qk_norm": True}, lambda layer: layer.qk_norm is not None),
])  # fmt: skip
def test_attention_options_reach_every_layer_of_every_role(kind, options, read):
    """catches: options that only the encoder (or no layer) receives."""
    model, b = small(attention=kind, attention_options=options), padded_batch()
    layers = [m for m in model.modules() if hasattr(m, "register_head_hook")]
    assert len(layers) == 3 * 2 and all(read(layer) for layer in layers)  # encoder, decoder, cross in 2 layers
    kw = {"src_key_mask": b.src_key_mask, "return_logits": True}
    tokens, lg = model.greedy_decode(b.src, 8, **kw)
    tokens_ref, lg_ref = model.greedy_decode(b.src, 8, use_cache=False, **kw)
    assert_greedy_agrees(tokens, tokens_ref, lg, lg_ref, start=1)


@pytest.mark.parametrize("options", [{"rope": True}, {"alibi": True}], ids=["rope", "alibi"])
def test_position_options_go_to_self_attention_only_and_cached_decoding_agrees(options):
    """catches: rope or ALiBi in cross-attention, whose cached steps placed every query at position 0
    (logits 0.1 off the uncached decode)."""
    model = small(attention_options=options)
    has = {"rope": lambda m: m.rope is not None, "alibi": lambda m: m.alibi_slopes is not None}[next(iter(options))]
    assert all(has(layer.self_attn) for layer in (*model.encoder, *model.decoder))
    assert not any(has(layer.cross_attn) for layer in model.decoder)
    src = torch.tensor([[3, 4, 5, 6, 7, 8, 2], [7, 8, 2, 0, 0, 0, 0]])
    kw = {"src_key_mask": src != 0, "return_logits": True}
    tokens, lg = model.greedy_decode(src, 9, **kw)
    tokens_ref, lg_ref = model.greedy_decode(src, 9, use_cache=False, **kw)
    assert_greedy_agrees(tokens, tokens_ref, lg, lg_ref, start=1)


def test_post_norm_and_shared_embeddings():
    model, b = small(norm_first=False, tie_embeddings=True, share_embeddings=True), padded_batch()
    assert isinstance(model.encoder_norm, torch.nn.Identity)
    assert model.out_proj.weight is model.tgt_embed.weight and model.src_embed is model.tgt_embed
    logits = model(b.src, b.tgt, src_key_mask=b.src_key_mask)
    logits.sum().backward()
    assert model.tgt_embed.weight.grad is not None


def test_base_preset_is_the_paper_base_model():
    c = PRESETS["base"]
    assert (c.embed_dim, c.num_encoder_layers, c.num_decoder_layers, c.num_heads, c.ffn_dim, c.dropout) == (
        512, 6, 6, 8, 2048, 0.1)
    assert c.norm_first is False
    with torch.device("meta"):
        model = Transformer(c)
    assert 60e6 < sum(p.numel() for p in model.parameters()) < 66e6  # the paper's "65M"


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match=r"'big'.*\['base', 'copy-task'\]"):
        TransformerConfig.from_preset("big")


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"embed_dim": 63}, ValueError, "embed_dim=63 is not divisible by num_heads=4"),
        ({"num_heads": 0}, ValueError, "num_heads=0"),
        ({"src_vocab_size": 2.5}, TypeError, "src_vocab_size=2.5"),
        ({"dropout": 1.0}, ValueError, "dropout=1.0"),
        ({"attention_dropout": -0.1}, ValueError, "attention_dropout=-0.1"),
        ({"attention": "linear"}, ValueError, r"'linear'.*'gqa'"),
        ({"num_kv_heads": 2}, ValueError, "num_kv_heads.*2"),
        ({"attention": "gqa", "num_kv_heads": 3}, ValueError, "num_kv_heads=3 must divide num_heads=4"),
        ({"eos_id": 11}, ValueError, "eos_id=11 .*tgt_vocab_size=11"),
        ({"bos_id": 0}, ValueError, "must differ, got 0, 0, 2"),
        ({"norm_first": 1}, TypeError, "norm_first=1"),
        ({"layer_norm_eps": 0.0}, ValueError, "layer_norm_eps=0.0"),
        ({"share_embeddings": True, "src_vocab_size": 12}, ValueError, "12 and 11"),
        ({"attention_options": ["overlap"]}, TypeError, r"attention_options must be a dict .* \['overlap'\]"),
        ({"attention_options": {"dropout": 0.1}}, ValueError, r"\['dropout'\] are set by the config or the model: use .*attention_dropout"),
        ({"attention_options": {"overlap": 1}}, TypeError, "overlap"),  # not an option of "mha"
        ({"attention": "overlapping", "attention_options": {"overlap": -1}}, ValueError, "overlap=-1"),
        ({"attention_options": {"window": 4}}, ValueError, r"window=4 would make every self-attention layer causal .*"
                                                           r"transformer_attention\(config, 'decoder', i, window=w\)"),
    ],
)
def test_config_validation_names_the_values(overrides, error, match):
    with pytest.raises(error, match=match):
        TransformerConfig.from_preset("copy-task", **overrides)


def test_inputs_are_checked():
    model, b = small(), padded_batch()
    with pytest.raises(TypeError, match="torch.long"):
        model.encode(b.src.float())
    with pytest.raises(ValueError, match=r"\[0, 11\), got min 0, max 11"):
        model.encode(torch.tensor([[0, 11]]))
    with pytest.raises(ValueError, match=r"\[4, 11\], got \[4, 10\]"):
        model.encode(b.src, b.src_key_mask[:, :-1])
    with pytest.raises(TypeError, match="bool"):
        model.encode(b.src, b.src_key_mask.long())
    with pytest.raises(ValueError, match="max_len=128"):
        model.greedy_decode(b.src, 200)
    with pytest.raises(ValueError, match=r"positions 0\.\.128 exceed max_len=128"):
        model.encode(torch.full((1, 129), 3))


def test_greedy_decoding_may_use_every_position_and_no_more():
    """max_len counts the bos: max_len - 1 decoder positions, at most config.max_len."""
    model, b = small(max_len=16), padded_batch()
    assert model.greedy_decode(b.src, 17).shape[1] <= 17
    with pytest.raises(ValueError, match="max_len - 1 = 17 decoder positions exceed config.max_len=16"):
        model.greedy_decode(b.src, 18)


def test_copy_task_batches_layout():
    b = padded_batch(batch=64)
    n = b.src_key_mask.sum(1) - 1  # tokens before eos
    assert b.src.shape == (64, L + 1) and b.tgt.shape == (64, L + 2)
    assert n.min() >= 3 and n.max() <= L
    assert (b.src[torch.arange(64), n] == 2).all() and (b.tgt[:, 0] == 1).all()
    assert torch.equal(b.tgt[:, 1:], b.src)
    body = b.src[torch.arange(L + 1)[None] < n[:, None]]
    assert body.min() >= 3 and body.max() <= V - 1
    assert torch.equal(b.tgt_key_mask, b.tgt != 0)
    with pytest.raises(ValueError, match="min_len=11 must be <= seq_len=10"):
        next(copy_task_batches(1, 2, 10, V, min_len=11))
