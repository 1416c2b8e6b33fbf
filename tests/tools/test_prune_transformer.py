"""prune_heads on the encoder-decoder Transformer: layers numbered as
attention_layers numbers them (encoder self-attention, then each decoder
layer's self- and cross-attention), the pruned model computes what the
unpruned one computes with those heads masked (encode, cached decode, greedy
decoding), its caches hold the kept key/value heads, its config rebuilds it,
and refusals match those for GPT."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from support.paths import assert_greedy_agrees, assert_paths_agree

from multihead.models.transformer import Transformer, TransformerConfig
from multihead.tools.heads import attention_layers, mask_heads
from multihead.tools.prune import prune_closed_heads, prune_heads

V = 13  # source and target vocabulary
BASE = dict(
    src_vocab_size=V, tgt_vocab_size=V, embed_dim=24, num_encoder_layers=2, num_decoder_layers=2, num_heads=6,
    ffn_dim=32, dropout=0.0, max_len=32,
)  # fmt: skip


def transformer(seed: int = 0, **overrides) -> Transformer:
    """A float64 model with N(0, 0.3^2) weights (LayerNorm gains near 1), so that every head matters."""
    torch.manual_seed(seed)
    model = Transformer(TransformerConfig(**{**BASE, **overrides})).double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3
            p.copy_(1.0 + noise if ".norm." in name or name.endswith("_norm.weight") else noise)
    return model


def batch(B: int = 3, S: int = 7, T: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, V, (B, S), generator=g)
    tgt = torch.randint(3, V, (B, T), generator=g)
    tgt[:, 0] = 1  # bos
    src_mask = torch.ones(B, S, dtype=torch.bool)
    src_mask[0, 5:] = False  # right padding in one source row
    src[0, 5:] = 0
    return src, tgt, src_mask


def run_all(model: Transformer, src, tgt, src_mask):
    """Memory, teacher-forced logits, logits decoded one token at a time through the caches,
    and greedy tokens with their logits."""
    memory = model.encode(src, src_mask)
    full = model.decode(tgt, memory, src_key_mask=src_mask)
    caches = model.make_kv_caches(tgt.shape[0], tgt.shape[1])
    steps = [model.decode(tgt[:, t : t + 1], memory, src_key_mask=src_mask, kv_caches=caches)
             for t in range(tgt.shape[1])]  # fmt: skip
    tokens, logits = model.greedy_decode(src, 6, src_key_mask=src_mask, return_logits=True)
    return memory, full, torch.cat(steps, dim=1), tokens, logits


# ---------------------------------------------------------------- numbering
def test_layers_are_numbered_as_attention_layers_numbers_them():
    model = transformer()
    enc, dec = model.encoder, model.decoder
    want = [enc[0].self_attn, enc[1].self_attn, dec[0].self_attn, dec[0].cross_attn, dec[1].self_attn,
            dec[1].cross_attn]  # fmt: skip
    assert [id(m) for m in attention_layers(model)] == [id(m) for m in want]
    prune_heads(model, {1: [0], 3: [1, 2], 4: [5]})
    assert model.config.encoder_layer_heads == [6, 5]
    assert model.config.decoder_layer_heads == [6, 5] and model.config.cross_layer_heads == [4, 6]
    assert [m.num_heads for m in attention_layers(model)] == [6, 5, 6, 4, 5, 6]
    assert model.config.encoder_layer_kv_heads is None  # num_kv_heads not set: no key/value lists


# ---------------------------------------------------------------- pruned equals masked
@pytest.mark.parametrize(
    ("overrides", "table", "kept"),
    [
        ({}, {0: [1, 4], 3: [0, 2, 5], 4: [3]}, [(4, 4), (6, 6), (6, 6), (3, 3), (5, 5), (6, 6)]),
        # GQA, H = 6, G = 3 (q0 q1 | q2 q3 | q4 q5): whole group 1; one head of every group; whole group 2
        (
            {"attention": "gqa", "num_kv_heads": 3},
            {1: [2, 3], 2: [0, 2, 4], 5: [4, 5]},
            [(6, 3), (4, 2), (3, 3), (6, 3), (6, 3), (4, 2)],
        ),
        ({"attention": "mqa"}, {0: [0, 1, 2, 3, 4], 5: [2]}, [(1, 1), (6, 1), (6, 1), (6, 1), (6, 1), (5, 1)]),
        ({"attention": "gated"}, {2: [1], 3: [0, 5]}, [(6, 6), (6, 6), (5, 5), (4, 4), (6, 6), (6, 6)]),
    ],  # fmt: skip
    ids=["mha", "gqa", "mqa", "gated"],
)
def test_pruned_transformer_equals_masked_transformer(overrides, table, kept):
    model = transformer(**overrides)
    inputs = batch()
    with torch.no_grad():
        plain = run_all(model, *inputs)
        with mask_heads(model, table):
            want = run_all(model, *inputs)
    # the masked heads matter: masking changes the memory (when an encoder layer is masked) and the logits
    assert not torch.allclose(want[1], plain[1], atol=1e-3)
    before = sum(p.numel() for p in model.parameters())
    prune_heads(model, table)
    with torch.no_grad():
        got = run_all(model, *inputs)
    real = inputs[2]  # memory rows at padded source positions are never read
    assert_paths_agree(got[0][real], want[0][real])
    assert_paths_agree(got[1], want[1])  # teacher-forced
    assert_paths_agree(got[2], want[2])  # one token at a time through the KV caches
    assert_paths_agree(got[2], got[1])  # cached equals full, after pruning
    assert_greedy_agrees(got[3], want[3], got[4], want[4], start=1)
    assert [(m.num_heads, m.num_kv_heads) for m in attention_layers(model)] == kept
    assert all(m.head_dim == 4 for m in attention_layers(model))
    assert before > sum(p.numel() for p in model.parameters())
    caches = model.make_kv_caches(2, 9)
    assert [tuple(c.k.shape) for c in caches.self_attn] == [(2, kept[2][1], 9, 4), (2, kept[4][1], 9, 4)]
    memory = model.encode(inputs[0][:2])
    model.decode(inputs[1][:2, :1], memory, kv_caches=caches)
    assert [tuple(c.v.shape) for c in caches.cross] == [(2, kept[3][1], 7, 4), (2, kept[5][1], 7, 4)]


def test_pruning_twice_and_rebuilding_from_the_config():
    # Heads are renumbered after each prune: [0, 2] of H = 6 in layer 3, then [3] of the 4 left (old head 5).
    model = transformer(seed=2, attention="gqa", num_kv_heads=2)
    reference = copy.deepcopy(model)
    prune_heads(model, {3: [0, 1, 2]})
    prune_heads(model, {3: [0], 0: [3, 4, 5]})
    c = model.config
    assert (c.encoder_layer_heads, c.decoder_layer_heads, c.cross_layer_heads) == ([3, 6], [6, 6], [2, 6])
    assert (c.encoder_layer_kv_heads, c.decoder_layer_kv_heads, c.cross_layer_kv_heads) == ([1, 2], [2, 2], [1, 2])
    inputs = batch(seed=3)
    with torch.no_grad(), mask_heads(reference, {3: [0, 1, 2, 3], 0: [3, 4, 5]}):
        want = reference(inputs[0], inputs[1], src_key_mask=inputs[2])
    with torch.no_grad():
        got = model(inputs[0], inputs[1], src_key_mask=inputs[2])
    assert_paths_agree(got, want)
    # There is no Transformer checkpoint format; its state dict loads into a model built from the pruned config.
    rebuilt = Transformer(model.config).double().eval()
    rebuilt.load_state_dict(model.state_dict())
    with torch.no_grad():  # same operations on the same weights and shapes: bitwise
        torch.testing.assert_close(rebuilt(inputs[0], inputs[1], src_key_mask=inputs[2]), got, rtol=0, atol=0)


def test_prune_closed_heads_of_a_gated_transformer():
    model = transformer(seed=4, attention="gated")
    with torch.no_grad():  # log 1/11 closes a gate: heads 1, 4 of decoder 1's cross-attention (layer 5)
        for m in attention_layers(model):
            m.log_alpha.clamp_(min=-2.0)
        model.decoder[1].cross_attn.log_alpha[[1, 4]] = -5.0
    inputs = batch(seed=5)
    with torch.no_grad():
        want = model(inputs[0], inputs[1], src_key_mask=inputs[2])
    assert prune_closed_heads(model) == {5: [1, 4]}
    assert model.config.cross_layer_heads == [6, 4] and model.decoder[1].cross_attn.log_alpha.numel() == 4
    with torch.no_grad():
        assert_paths_agree(model(inputs[0], inputs[1], src_key_mask=inputs[2]), want)


# ---------------------------------------------------------------- refusals
def test_refusals_name_the_values_and_change_nothing():
    model = transformer(attention="gqa", num_kv_heads=3)
    config, state = model.config, {k: v.clone() for k, v in model.state_dict().items()}
    for table, error, match in [
        ({6: [0]}, ValueError, r"layer index=6 out of range \[0, 6\) \(6 attention layers\)"),
        ({3: [6]}, ValueError, r"head=6 out of range \[0, 6\) in layer 3 with 6 heads"),
        ({5: list(range(6))}, ValueError, r"layer 5 would keep no heads"),
        ({2: [0]}, ValueError, r"layer 2: .*different numbers of query heads \{0: 1, 1: 2, 2: 2\}"),
    ]:
        with pytest.raises(error, match=match):
            prune_heads(model, {1: [2, 3], **table})  # layer 1 alone would be fine
    assert model.config is config
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    mixed = Transformer(TransformerConfig(**{**BASE, "attention": "talking_heads", "num_heads": 4}))
    with pytest.raises(ValueError, match=r"attention kind 'talking_heads' cannot lose one head alone: the composition mixes heads"):
        prune_heads(mixed, {0: [1]})
    with pytest.raises(ValueError, match=r"needs an attention kind with head gates \(closed_heads\(\), as 'gated'\), got attention='mha'"):
        prune_closed_heads(transformer())


def test_config_per_layer_counts_default_and_validate():
    plain = TransformerConfig(**BASE)
    assert all(
        getattr(plain, f) is None for f in ("encoder_layer_heads", "decoder_layer_kv_heads", "cross_layer_heads")
    )
    assert TransformerConfig(**dataclasses.asdict(plain)) == plain and plain.head_dim == 4
    pruned = TransformerConfig(**BASE, attention="gqa", num_kv_heads=3, encoder_layer_heads=(6, 2),
                               encoder_layer_kv_heads=[3, 1], cross_layer_heads=[3, 6])  # fmt: skip
    assert pruned.encoder_layer_heads == [6, 2] and TransformerConfig(**dataclasses.asdict(pruned)) == pruned
    assert [m.num_heads for m in attention_layers(Transformer(pruned))] == [6, 2, 6, 3, 6, 6]
    bad = [
        ({"encoder_layer_heads": [6]}, ValueError,
         r"encoder_layer_heads / encoder_layer_kv_heads: layer_heads must list one count per layer \(2\), got 1"),
        ({"decoder_layer_heads": [6, 7]}, ValueError,
         r"decoder_layer_heads .*may not exceed num_heads=6; layers \{1: 7\} do"),
        ({"cross_layer_heads": [0, 6]}, ValueError, r"cross_layer_heads .*layer_heads\[0\]=0"),
        ({"cross_layer_heads": "66"}, TypeError, r"cross_layer_heads .*must be a list of 2 ints"),
        ({"cross_layer_kv_heads": [1, 1]}, ValueError, r"cross_layer_kv_heads: layer_kv_heads=\[1, 1\] needs"),
        ({"attention": "gqa", "num_kv_heads": 3, "decoder_layer_heads": [6, 4]}, ValueError,
         r"decoder_layer_heads .*\(layer_heads, key/value heads\) of layers \{1: \(4, 3\)\}"),
        ({"attention": "talking_heads", "num_heads": 4, "encoder_layer_heads": [4, 3]}, ValueError,
         r"encoder_layer_heads .*independent heads; attention='talking_heads' has none"),
    ]  # fmt: skip
    for fields, error, match in bad:
        with pytest.raises(error, match=match):
            TransformerConfig(**{**BASE, **fields})
