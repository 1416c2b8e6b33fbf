"""``multihead inspect --hf DIR`` and ``--importance``.

References are independent of the command: attention weights from
transformers' own eager attention (``output_attentions=True``), and each
head's ablation from a copy of the model whose output projection has that
head's input columns zeroed (which silences the head exactly), run without
any head hook. Different operations: float32 tolerances, never bitwise.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from support.cli import quietly  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from tokenizers.pre_tokenizers import Whitespace  # noqa: E402
from tokenizers.processors import TemplateProcessing  # noqa: E402

from multihead.models.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from multihead.models.gpt import GPT, GPTConfig  # noqa: E402
from multihead.tools.capture import AttentionRecord, LayerAttention  # noqa: E402
from multihead.tools.roles import classify_heads  # noqa: E402

WORDS = "the cat sat on mat a dog ran to park and . ,".split()
TEXT = "the cat sat on the mat , a dog ran to the park ."


def refused(*argv: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr; return that line."""
    rc, out, err = quietly("inspect", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("multihead inspect: error: "), err
    return err.strip()


def word_tokenizer(bert: bool) -> Tokenizer:
    specials = ["[UNK]", "[CLS]", "[SEP]"]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(specials + WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    if bert:
        tok.post_processor = TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    return tok


def save_hf(folder: Path, kind: str) -> Path:
    """A random tiny BERT or GPT-2 with a word-level tokenizer.json, as a Hugging Face folder."""
    torch.manual_seed(0)
    V = 3 + len(WORDS)
    if kind == "bert":
        config = transformers.BertConfig(vocab_size=V, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=40, max_position_embeddings=32)  # fmt: skip
        model = transformers.BertModel(config)
    else:
        config = transformers.GPT2Config(vocab_size=V, n_embd=24, n_layer=2, n_head=4, n_positions=32)
        model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    word_tokenizer(kind == "bert").save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module", params=["bert", "gpt2"])
def hf_folder(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, save_hf(tmp_path_factory.mktemp(request.param), request.param)


def eager(folder: Path) -> torch.nn.Module:
    return transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()


def silence(model: torch.nn.Module, kind: str, layer: int, head: int) -> torch.nn.Module:
    """A copy whose head ``head`` of ``layer`` adds nothing to the output projection."""
    m = copy.deepcopy(model)
    H = m.config.num_attention_heads
    D = m.config.hidden_size // H
    with torch.no_grad():
        if kind == "bert":
            m.encoder.layer[layer].attention.output.dense.weight[:, head * D : (head + 1) * D] = 0  # (C, H*D)
        else:
            m.h[layer].attn.c_proj.weight[head * D : (head + 1) * D, :] = 0  # Conv1D: (H*D, C)
    return m


def embedding_distance(model, reference: torch.Tensor, ids: torch.Tensor) -> float:
    with torch.no_grad():
        e = model(input_ids=ids).last_hidden_state.mean(dim=1).double()  # (1, T, C) -> (1, C)
    return float(1 - F.cosine_similarity(e, reference, dim=-1))


def test_hf_folder_weights_roles_and_importance(hf_folder, tmp_path):
    kind, folder = hf_folder
    out = tmp_path / "out"
    rc, stdout, err = quietly("inspect", TEXT, "--hf", str(folder), "--importance", "--out", str(out))
    assert rc == 0, err
    assert stdout.startswith(f"{kind} model {folder}: 2 layers x 4 heads")
    assert "most important (ablation): L" in stdout and "Loading weights" not in err
    saved = json.loads((out / "heads.json").read_text())
    ids = torch.tensor([word_tokenizer(kind == "bert").encode(TEXT).ids])  # (1, T)
    ref = eager(folder)
    with torch.no_grad():
        weights = ref(input_ids=ids, output_attentions=True).attentions  # L x (1, H, T, T)
    for layer, entry in enumerate(saved["layers"]):
        torch.testing.assert_close(torch.tensor(entry["weights"]), weights[layer][0])
    with torch.no_grad():
        base = ref(input_ids=ids).last_hidden_state.mean(dim=1).double()  # (1, C)
    for role in saved["roles"]:
        want = embedding_distance(silence(ref, kind, role["layer"], role["head"]), base, ids)
        assert role["scores"]["importance"] == pytest.approx(want, rel=1e-3, abs=1e-6), role
    # roles scored on what each query could see: GPT-2 causal, BERT the whole text
    record = AttentionRecord(query_tokens=saved["query_tokens"])
    record.layers = [LayerAttention(layer=i, name="", kind="mha", weights=w) for i, w in enumerate(weights)]
    T = ids.shape[1]
    visible = torch.ones(T, T, dtype=torch.bool)
    want = classify_heads(record, token_ids=ids[0].tolist(), mask=visible.tril() if kind == "gpt2" else visible)
    assert [r["labels"] for r in saved["roles"]] == [r.labels for r in want]
    for got, r in zip(saved["roles"], want):
        for name, value in r.scores.items():
            assert got["scores"][name] == pytest.approx(value, abs=1e-5), (name, got)
    html = (out / "heads.html").read_text()
    assert "importance" in html


def test_gpt_checkpoint_importance_is_the_lm_loss_increase(tmp_path):
    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32)), ckpt)
    text = "To be, or not"
    rc, stdout, err = quietly("inspect", text, "--checkpoint", str(ckpt), "--importance", "--out", str(tmp_path / "o"))
    assert rc == 0, err
    assert "most important (ablation): L" in stdout and "importance  ablation" not in stdout  # the summary
    rc, stdout, err = quietly("inspect", text, "--checkpoint", str(ckpt), "--importance", "--verbose",
                              "--out", str(tmp_path / "o"))  # fmt: skip
    assert rc == 0, err
    legend = stdout[stdout.index("columns: "):stdout.index("scores not in the table")]  # the table's columns
    assert "  importance     no role  ablation: the loss increase" in legend  # --verbose: the column and its legend
    roles = json.loads((tmp_path / "o" / "heads.json").read_text())["roles"]
    model = load_checkpoint(ckpt).eval()
    ids = torch.tensor([list(text.encode())])  # (1, T)
    D = model.config.embed_dim // model.config.num_heads

    def lm_loss(m) -> float:
        with torch.no_grad():
            return float(F.cross_entropy(m(ids[:, :-1])[0], ids[0, 1:]))

    base = lm_loss(model)
    assert len(roles) == 8
    for role in roles:
        m = copy.deepcopy(model)
        with torch.no_grad():
            m.blocks[role["layer"]].attn.out_proj.weight[:, role["head"] * D : (role["head"] + 1) * D] = 0  # (C, H*D)
        assert role["scores"]["importance"] == pytest.approx(lm_loss(m) - base, rel=1e-4, abs=1e-6), role
    line = refused("T", "--checkpoint", str(ckpt), "--importance", "--out", str(tmp_path / "o2"))
    assert "the text has 1 token" in line


def test_minilm_folder_through_hf_equals_the_packaged_encoder(tmp_path):
    from multihead.models.minilm import MissingWeightsPackageError, minilm_model_dir

    try:
        folder = minilm_model_dir()
    except MissingWeightsPackageError as err:
        pytest.skip(str(err))
    text = "Its application should be just."
    runs = {}
    for name, flags in {"hf": ["--hf", str(folder)], "packaged": []}.items():
        rc, _, err = quietly("inspect", text, *flags, "--layer", "5", "--out", str(tmp_path / name))
        assert rc == 0, err
        runs[name] = json.loads((tmp_path / name / "heads.json").read_text())
    assert runs["hf"]["query_tokens"] == runs["packaged"]["query_tokens"]
    torch.testing.assert_close(
        torch.tensor(runs["hf"]["layers"][0]["weights"]), torch.tensor(runs["packaged"]["layers"][0]["weights"])
    )
    assert [r["labels"] for r in runs["hf"]["roles"]] == [r["labels"] for r in runs["packaged"]["roles"]]
    rc, _, err = quietly("inspect", text, "--importance", "--layer", "5", "--out", str(tmp_path / "scored"))
    assert rc == 0, err
    roles = json.loads((tmp_path / "scored" / "heads.json").read_text())["roles"]
    ref = eager(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()  # the file pads to 128; one sentence needs no padding
    ids = torch.tensor([tok.encode(text).ids])  # (1, T)
    with torch.no_grad():
        base = ref(input_ids=ids).last_hidden_state.mean(dim=1).double()  # (1, C)
    assert [r["layer"] for r in roles] == [5] * 12
    for role in roles:
        want = embedding_distance(silence(ref, "bert", 5, role["head"]), base, ids)
        assert role["scores"]["importance"] == pytest.approx(want, rel=1e-3, abs=1e-6), role


def test_hf_mistakes_are_one_line(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = str(tmp_path / "out")
    assert f"--hf {empty}: no config.json in it" in refused("x", "--hf", str(empty), "--out", out)
    assert f"--hf {tmp_path / 'nope'}: no such folder" in refused("x", "--hf", str(tmp_path / "nope"), "--out", out)
    (empty / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    assert "no tokenizer.json in it" in refused("x", "--hf", str(empty), "--out", out)
    word_tokenizer(True).save(str(empty / "tokenizer.json"))
    assert f"--hf {empty}: not a transformers model folder" in refused("the cat", "--hf", str(empty), "--out", out)
    line = refused("x", "--hf", str(empty), "--model", "minilm-l6", "--out", out)
    assert "cannot go with --model minilm-l6" in line
    line = refused("x", "--hf", str(empty), "--checkpoint", "ck", "--out", out)
    assert "cannot go with --checkpoint ck" in line
    assert not Path(out).exists()
