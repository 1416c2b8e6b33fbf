"""``multihead inspect --corpus FILE``: roles over every line, the views of one text, one-line mistakes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from support.cli import quietly

from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig

pytest.importorskip("matplotlib")

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "sentences.txt"
LINES = [line for line in EXAMPLE.read_text(encoding="utf-8").splitlines() if line.strip()]


def refused(*argv: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr; return that line."""
    rc, out, err = quietly("inspect", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("multihead inspect: error: "), err
    return err.strip()


@pytest.fixture(scope="module")
def minilm_corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus")
    rc, stdout, err = quietly("inspect", "--corpus", str(EXAMPLE), "--out", str(out))
    assert rc == 0, err
    return out, stdout, err


def test_the_documented_example_prints_roles_over_the_lines_with_their_spread(minilm_corpus):
    from multihead.models import load_minilm
    from multihead.tools.corpus_roles import corpus_roles

    out, stdout, err = minilm_corpus
    assert stdout.startswith(f"all-MiniLM-L6-v2: 6 layers x 12 heads; roles over 12 texts of {EXAMPLE}")
    assert "[CLS] the law will never be perfect , but its application should be just . [SEP]" in stdout
    assert re.search(r"^  cls +>= 0\.50 +\d+ heads +L\d H\d+ \d\.\d\d±\d\.\d\d", stdout, re.M), stdout
    assert "corpus 2/2" in err  # progress: one plain line per batch of 8 lines
    saved = json.loads((out / "heads.json").read_text())
    assert saved["query_tokens"][1:4] == ["the", "law", "will"]  # no TEXT: the views show the first line
    want = corpus_roles(load_minilm(), LINES, progress=False)
    assert len(saved["roles"]) == len(want.heads) == 72
    for role, h in zip(saved["roles"], want.heads):
        assert (role["layer"], role["head"], role["labels"]) == (h.layer, h.head, h.labels)
        assert role["texts"] == 12 and role["evidence"]["cls"]["keys"] == 12
        for name, s in h.stats.items():
            assert role["scores"][name] == pytest.approx(s.mean, abs=1e-6)
            assert role["spread"][name] == pytest.approx(s.sd, abs=1e-6)
            assert role["evidence"][name]["rows"] == s.rows


def test_verbose_prints_the_table_with_mean_spread_and_texts(tmp_path):
    rc, stdout, err = quietly("inspect", "A cat sat on the mat.", "--corpus", str(EXAMPLE), "--layer", "0",
                              "--verbose", "--out", str(tmp_path))  # fmt: skip
    assert rc == 0, err
    table = stdout.split("\n\n")[1].splitlines()
    assert table[0].split()[:5] == ["layer", "head", "roles", "texts", "previous"]
    assert len(table) == 1 + 12 and all(row.split()[3] == "12" for row in table[1:])
    assert all(re.fullmatch(r"\d\.\d\d±\d\.\d\d", cell) for row in table[1:] for cell in row.split()[-10:-2])
    assert "texts     no role  texts of the corpus that measured the head" in stdout
    assert "rare      >= 0.50  mean weight on the text's word that is rarest in the corpus" in stdout
    saved = json.loads((tmp_path / "heads.json").read_text())
    assert saved["query_tokens"] == ["[CLS]", "a", "cat", "sat", "on", "the", "mat", ".", "[SEP]"]
    assert [entry["layer"] for entry in saved["layers"]] == [0]


@pytest.fixture(scope="module")
def gpt_ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt")
    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig.from_preset("tiny")), folder / "bytes")  # byte-level, context 128
    return folder / "bytes"


def test_a_gpt_checkpoint_counts_the_rows_each_query_could_choose(gpt_ckpt, tmp_path):
    corpus = tmp_path / "lines.txt"
    lines = ["to be or not", "that is the question", "", "whether tis nobler"]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rc, stdout, err = quietly("inspect", "--corpus", str(corpus), "--checkpoint", str(gpt_ckpt),
                              "--batch-size", "2", "--out", str(tmp_path / "out"))  # fmt: skip
    assert rc == 0, err
    assert "roles over 3 texts" in stdout
    assert stdout.index("causal roles (") < stdout.index("roles over 3 texts:")  # a causal model's roles still lead
    saved = json.loads((tmp_path / "out" / "heads.json").read_text())
    assert "".join(saved["query_tokens"]) == "to be or not" and saved["causal"]
    for role in saved["roles"]:  # causal: query 0 of each line sees one key and is no row
        assert role["evidence"]["broad"]["rows"] == sum(len(line) - 1 for line in lines if line)
        assert role["evidence"]["previous"]["texts"] == 3


def save_hf(folder: Path, kind: str) -> Path:
    """A random tiny BERT or GPT-2 with a word-level tokenizer.json, as a Hugging Face folder."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing

    words = ["[UNK]", "[CLS]", "[SEP]", *"the cat sat on mat a dog ran to park and . ,".split()]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    torch.manual_seed(0)
    if kind == "bert":
        tok.post_processor = TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
        config = transformers.BertConfig(vocab_size=len(words), hidden_size=24, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=40, max_position_embeddings=32)  # fmt: skip
        model = transformers.BertModel(config)
    else:
        config = transformers.GPT2Config(vocab_size=len(words), n_embd=24, n_layer=2, n_head=4, n_positions=32)
        model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_a_hugging_face_folder(kind, tmp_path):
    pytest.importorskip("transformers")
    folder = save_hf(tmp_path / kind, kind)
    corpus = tmp_path / "lines.txt"
    lines = ["the cat sat on the mat .", "a dog ran to the park", "the dog sat , the cat ran"]
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    rc, stdout, err = quietly("inspect", "--corpus", str(corpus), "--hf", str(folder), "--out", str(tmp_path / "out"))
    assert rc == 0, err
    assert stdout.startswith(f"{kind} model {folder}: 2 layers x 4 heads; roles over 3 texts")
    saved = json.loads((tmp_path / "out" / "heads.json").read_text())
    assert len(saved["roles"]) == 8 and all(r["texts"] == 3 for r in saved["roles"])
    words = [len(line.split()) for line in lines]
    rows = sum(n + 2 for n in words) if kind == "bert" else sum(n - 1 for n in words)  # [CLS] w.. [SEP]; causal
    assert all(r["evidence"]["broad"]["rows"] == rows for r in saved["roles"])


def test_mistakes_are_one_line_and_write_nothing(gpt_ckpt, tmp_path, monkeypatch):
    import multihead.models.minilm as minilm

    def forbidden(*args, **kwargs):
        pytest.fail("a model was loaded before the mistake was reported")

    monkeypatch.setattr(minilm, "load_minilm", forbidden)  # the file's mistakes come first
    out = tmp_path / "out"
    missing = tmp_path / "missing.txt"
    assert refused("--corpus", str(missing), "--out", str(out)).endswith(f"--corpus {missing}: no such file "
                                                                         "(expected a UTF-8 text file, one text per line)")  # fmt: skip
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert refused("--corpus", str(empty), "--out", str(out)).endswith(f"--corpus {empty} is empty: give one text per line")
    blank = tmp_path / "blank.txt"
    blank.write_text("\n   \n\t\n", encoding="utf-8")
    assert refused("--corpus", str(blank), "--out", str(out)).endswith(f"--corpus {blank} has no text: its 3 lines are blank")
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 au lait\nna\u00efve\n".encode("latin-1"))
    assert refused("--corpus", str(latin), "--out", str(out)).endswith(f"--corpus {latin} is not UTF-8 text: byte 0xe9 on line 1")
    assert "--importance scores the heads on one text" in refused("--corpus", str(EXAMPLE), "--importance", "--out", str(out))
    assert "--batch-size 0: give a positive number" in refused("--corpus", str(EXAMPLE), "--batch-size", "0", "--out", str(out))
    monkeypatch.undo()
    long = tmp_path / "long.txt"
    long.write_text("short line\n\n" + "x" * 200 + "\n", encoding="utf-8")
    line = refused("--corpus", str(long), "--checkpoint", str(gpt_ckpt), "--out", str(out))
    assert line.endswith(f"--corpus {long} line 3: the text is 200 bytes, more than the checkpoint {gpt_ckpt}'s "
                         "maximum of 128: shorten it, or pass --truncate to analyse only the first 128")  # fmt: skip
    assert not out.exists()
    rc, stdout, err = quietly("inspect", "--corpus", str(long), "--checkpoint", str(gpt_ckpt), "--truncate", "--out", str(out))
    assert rc == 0, err
    note = f"notice: 1 line of {long} was longer than the model's maximum of 128 tokens: only their first tokens were scored"
    assert f"{note} (--truncate); line 3" in stdout


def test_lines_the_tokenizer_does_not_know_get_a_notice(tmp_path):
    corpus = tmp_path / "emoji.txt"
    corpus.write_text("hello \U0001f600 \U0001f389\n\U0001f680 \U0001f600 there\nthe law is just\n", encoding="utf-8")
    rc, stdout, err = quietly("inspect", "--corpus", str(corpus), "--layer", "0", "--out", str(tmp_path / "out"))
    assert rc == 0, err
    assert f"notice: 4 of 10 words of {corpus} became [UNK] (unknown to the tokenizer): roles over these lines say little" in stdout
    page = (tmp_path / "out" / "heads.html").read_text(encoding="utf-8")
    assert "4 of 10 words of" in page


def test_two_lines_are_too_little_evidence_for_any_role(tmp_path):
    corpus = tmp_path / "two.txt"
    corpus.write_text("\n".join(LINES[:2]) + "\n", encoding="utf-8")
    rc, stdout, err = quietly("inspect", "--corpus", str(corpus), "--layer", "1", "--out", str(tmp_path / "out"))
    assert rc == 0, err
    assert "roles over 2 texts: 0 of 12 heads have one" in stdout
    roles = json.loads((tmp_path / "out" / "heads.json").read_text())["roles"]
    passed = [r for r in roles if r["scores"]["cls"] >= 0.5 and r["scores"]["cls"] - r["chance"]["cls"] >= 0.25]
    assert passed and all(r["labels"] == [] for r in roles)
    assert [r["head"] for r in roles if "cls" in r["withheld"]] == [r["head"] for r in passed]
    line = next(x for x in stdout.splitlines() if x.startswith("  cls "))
    assert f"no head   {len(passed)} withheld, too little evidence: " in line and "(2 texts, " in line


def test_a_pruned_checkpoint_keeps_its_heads_where_they_were(tmp_path):
    from multihead.tools import prune_heads

    torch.manual_seed(0)
    ckpt = tmp_path / "pruned"
    save_checkpoint(prune_heads(GPT(GPTConfig.from_preset("tiny")), {0: [1, 2]}), ckpt)  # 2 + 4 of 8 heads
    corpus = tmp_path / "lines.txt"
    corpus.write_text("to be or not to be\nthat is the question\nwhether tis nobler\n", encoding="utf-8")
    rc, stdout, err = quietly("inspect", "--corpus", str(corpus), "--checkpoint", str(ckpt), "--out", str(tmp_path / "o"))
    assert rc == 0, err
    assert stdout.startswith("GPT checkpoint pruned: 2 layers, 6 of 8 heads kept (2 pruned); roles over 3 texts")
    saved = json.loads((tmp_path / "o" / "heads.json").read_text())
    assert [(r["layer"], r["head"]) for r in saved["roles"]] == [(0, 0), (0, 1), *((1, h) for h in range(4))]
    assert len(saved["pruned"]) == 2
