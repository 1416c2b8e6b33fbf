"""``multihead inspect``: the head explorer on the real MiniLM and on a GPT checkpoint."""

from __future__ import annotations

import html as html_lib
import json
import re

import pytest
import torch

from multihead.cli import main
from multihead.commands.inspect import DEFAULT_TEXT, inspect_text
from multihead.commands.inspect_report import format_links, shown_links
from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig


@pytest.fixture(scope="module")
def minilm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect")
    return out, inspect_text(DEFAULT_TEXT)


def test_default_sentence_on_minilm(tmp_path, capsys):
    assert main(["inspect", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "all-MiniLM-L6-v2: 6 layers x 12 heads" in printed
    assert "[CLS] the law will never be perfect , but its application should be just . [SEP]" in printed
    assert "roles: " in printed and "top links between words" in printed and "--verbose prints" in printed
    assert "layer  head  roles" not in printed and "strongest token links per head" not in printed  # the summary
    assert len(printed.splitlines()) < 30
    assert "notice:" not in printed  # an English sentence of 16 tokens: nothing to say
    for name in ("heads.html", "heads.png", "heads.json"):
        assert (tmp_path / name).stat().st_size > 1000
        assert str((tmp_path / name).resolve()) in printed
    data = json.loads((tmp_path / "heads.json").read_text())
    assert len(data["layers"]) == 6 and len(data["query_tokens"]) == 16


def test_real_heads_get_roles(minilm_run):
    _, found = minilm_run
    assert len(found.roles) == 6 * 12
    labels = {label for r in found.roles for label in r.labels}
    # all-MiniLM-L6-v2 has a previous-token head in layer 0 and many [CLS] heads
    assert "previous" in labels and "cls" in labels
    assert any(r.layer == 0 and "previous" in r.labels for r in found.roles)


def test_one_layer_only(tmp_path, capsys):
    assert main(["inspect", "Its application should be just.", "--layer", "2", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "heads.json").read_text())
    assert [entry["layer"] for entry in data["layers"]] == [2]
    assert capsys.readouterr().out.startswith("all-MiniLM-L6-v2: 1 layer (layer 2) x 12 heads on\n")


def test_verbose_prints_every_head_the_legend_of_its_columns_and_every_heads_links(tmp_path, capsys):
    from multihead.tools.roles import NO_ROLE, SCORE_MEANINGS

    assert main(["inspect", "--verbose", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    table = printed.split("\n\n")[1].splitlines()
    assert table[0].split() == ["layer", "head", "roles", "previous", "next", "self", "cls", "sep", "punct", "broad",
                                "rare", "entropy", "distance"]  # fmt: skip
    assert len(table) == 1 + 72 and all(row.split()[2] != "-" for row in table[1:])  # no role is "none", not "-"
    assert any(row.split()[2] == NO_ROLE for row in table[1:])
    legend = printed.split("\n\n")[2]
    assert "'-' in a score column: not measurable" in " ".join(legend.split())
    assert f"'{NO_ROLE}' in the roles column: no role" in " ".join(legend.split())
    for column in table[0].split()[3:]:  # every column of the table has its line, in table order
        assert f"  {column} " in legend and SCORE_MEANINGS[column] in legend
    assert [line.split()[0] for line in legend.splitlines() if line.startswith("  ")] == [
        *table[0].split()[3:], "previous_mass", "next_mass", "self_mass"]  # fmt: skip
    assert "strongest token links per head" in printed and printed.count("\n  L") >= 72


def test_summary_lists_each_roles_strongest_heads_and_the_top_links(minilm_run, tmp_path):
    from multihead.commands.inspect_report import report
    from multihead.tools.roles import ROLE_THRESHOLDS
    from multihead.tools.token_kinds import is_special

    _, found = minilm_run
    lines: list[str] = []
    report(found, tmp_path, echo=lines.append)
    printed = "\n".join(lines)
    lines = printed.splitlines()
    for role in ROLE_THRESHOLDS:
        line = next(line for line in lines if line.startswith(f"  {role} "))
        having = sorted((r for r in found.roles if role in r.labels), key=lambda r: -r.scores[role])
        if having:
            count = f"{len(having)} head" + ("s" if len(having) > 1 else "")
            listed = ", ".join(f"L{r.layer} H{r.head} {r.scores[role]:.2f}" for r in having[:4])
            assert f"{count}   {listed}" in line, line
        else:
            best = max(found.roles, key=lambda r: r.scores[role])
            assert f"no head   closest: L{best.layer} H{best.head} {best.scores[role]:.2f}" in line, line
    none = sum(not r.labels for r in found.roles)
    assert f"{none} heads   (no role reached)" in printed
    # the first top link is the largest weight of any head between two different non-special positions
    tokens = found.record.query_tokens
    best = max(
        (float(entry.weights[0, h, i, j]), i, j)
        for entry in found.record.layers for h in range(entry.num_heads)
        for i in range(len(tokens)) for j in range(len(tokens))
        if i != j and not is_special(tokens[i]) and not is_special(tokens[j])
    )  # fmt: skip
    first = lines[lines.index(next(x for x in lines if x.startswith("top links"))) + 1]
    assert first.split()[3] == f"{best[0]:.2f}" and first.split()[:3] == [tokens[best[1]], "->", tokens[best[2]]]


def test_gpt_checkpoint(tmp_path, capsys):
    ckpt = tmp_path / "tiny-init"
    assert main(["generate", "--preset", "tiny", "--seed", "0", "--save-init", str(ckpt)]) == 0
    assert main(["inspect", "To be, or not", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "2 layers x 4 heads" in printed
    data = json.loads((tmp_path / "out" / "heads.json").read_text())
    assert data["query_tokens"][:3] == ["T", "o", " "]
    weights = data["layers"][0]["weights"][0]
    assert weights[0][1] == 0.0  # causal: the first token sees only itself


@pytest.mark.parametrize(
    "argv,message",
    [
        (["inspect", "text", "--layer", "9"], "--layer 9 out of range: the model has layers 0..5"),
        (["inspect", "text", "--checkpoint", "/nonexistent/ckpt"], "multihead inspect: error:"),
    ],
)
def test_errors_are_reported_not_raised(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


# -- long texts, unknown words, the links list ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A byte-level GPT (2 layers x 4 heads, context 128) and one with a 300-word vocabulary."""
    folder = tmp_path_factory.mktemp("ckpts")
    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig.from_preset("tiny")), folder / "bytes")
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", vocab_size=300)), folder / "words")
    return folder


def page_data(path):
    page = path.read_text("utf-8")
    title = html_lib.unescape(re.search(r"<title>(.*?)</title>", page, re.S).group(1))
    data = json.loads(re.search(r'id="mh-data">(.*?)</script>', page, re.S).group(1))
    return title, data


def test_truncate_analyses_the_first_tokens_and_says_so(tiny_ckpt, tmp_path, capsys):
    text = "To be, or not to be, that is the question. " * 4  # 172 bytes > context 128
    out = tmp_path / "out"
    assert main(["inspect", text, "--checkpoint", str(tiny_ckpt / "bytes"), "--truncate", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    analysed = text.encode()[:128].decode()
    notice = f"the text is {len(text.encode())} tokens, more than the checkpoint {tiny_ckpt / 'bytes'}'s maximum of 128"
    assert f"notice: {notice}: only the first 128 were analysed" in printed
    assert f'up to "...{analysed[-40:].lstrip()}" (--truncate)' in printed
    data = json.loads((out / "heads.json").read_text())
    assert "".join(data["query_tokens"]) == analysed
    title, page = page_data(out / "heads.html")
    assert title == f"GPT checkpoint bytes: {' '.join(analysed.split())} (first 128 of 172 tokens)"
    assert len(page["notices"]) == 1 and page["notices"][0].startswith(notice)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i for i, w in enumerate("to be or not that is the question".split(), 1)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize("text, unknown", [("to be or xyzzy", 1), ("to be plugh xyzzy", 2), ("to plugh xyzzy frob", 3)])
def test_a_notice_when_more_than_a_quarter_of_the_words_are_unknown(text, unknown, tiny_ckpt, word_tokenizer, tmp_path, capsys):
    argv = ["inspect", text, "--checkpoint", str(tiny_ckpt / "words"), "--tokenizer", str(word_tokenizer)]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    _, page = page_data(tmp_path / "heads.html")
    notice = f"{unknown} of 4 words became [UNK] (unknown to the tokenizer)"
    if unknown > 1:  # more than a quarter
        assert f"notice: {notice}" in printed and page["notices"][0].startswith(notice)
    else:
        assert "notice:" not in printed and page["notices"] == []


def test_minilm_notice_names_the_model_language(capsys):
    found = inspect_text("\U0001f600 \U0001f389 \U0001f680 hello", layer=0)
    assert found.record.query_tokens == ["[CLS]", "[UNK]", "[UNK]", "[UNK]", "hello", "[SEP]"]
    assert found.notices == [
        "3 of 4 words became [UNK] (unknown to the tokenizer); all-MiniLM-L6-v2 is an English, uncased model: "
        "roles and links on this text say little"
    ]


def brute_force_links(weights, visible, k=3):
    """Every allowed (query, key) of rows with at least two allowed keys, by weight, ties row-major."""
    T, S = weights.shape
    pairs = [(float(weights[i, j]), i, j) for i in range(T) for j in range(S) if visible[i, j] and visible[i].sum() >= 2]
    pairs.sort(key=lambda p: (-p[0], p[1], p[2]))
    return [(i, j, w) for w, i, j in pairs[:k] if w > 0]


def test_links_skip_rows_with_one_allowed_key(tiny_ckpt):
    found = inspect_text("aaa bbb aaa", checkpoint=str(tiny_ckpt / "bytes"))
    visible = torch.ones(11, 11, dtype=torch.bool).tril()
    links = shown_links(found)
    assert len(links) == len(found.roles) == 8
    heads = [(entry, h) for entry in found.record.layers for h in range(entry.num_heads)]
    for (entry, h), got in zip(heads, links):
        assert [(link.query_index, link.key_index, link.weight) for link in got] == brute_force_links(
            entry.weights[0, h].double(), visible
        )  # same weights read back: exact
        assert all(link.query_index > 0 for link in got)  # the first token sees itself only


def test_links_show_special_tokens_and_number_repeated_words(minilm_run):
    _, found = minilm_run
    links = shown_links(found)
    tokens = found.record.query_tokens
    assert any(tokens[link.key_index] in ("[CLS]", "[SEP]") for head in links for link in head)
    visible = torch.ones(len(tokens), len(tokens), dtype=torch.bool)
    heads = [(entry, h) for entry in found.record.layers for h in range(entry.num_heads)]
    for (entry, h), got in zip(heads[::7], links[::7]):  # every 7th head: 11 of 72
        want = brute_force_links(entry.weights[0, h].double(), visible)
        assert [(link.query_index, link.key_index, link.weight) for link in got] == want
    table = format_links(found.roles, links, tokens)
    assert tokens.count("be") == 2 and tokens.count("the") == 1
    assert re.search(r"\bbe\b(?!#)", table) is None  # "be" occurs twice: always with its position
    assert re.search(r"\bbe#(5|12)\b", table) and "the#" not in table


@pytest.mark.parametrize("text", ["la " * 20, "buffalo " * 8])
def test_a_repeated_word_is_not_a_rare_word(text, tmp_path, capsys):
    assert main(["inspect", text, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    rare = next(line for line in printed.splitlines() if line.startswith("  rare "))
    assert rare.split()[3:] == ["-", "not", "measurable", "on", "this", "input"], rare
    roles = json.loads((tmp_path / "heads.json").read_text())["roles"]
    assert len(roles) == 72 and not any("rare" in r["labels"] or "rare" in r["scores"] for r in roles)


def test_a_rare_role_beats_the_share_of_its_word_by_the_margin():
    from multihead.tools.roles import ROLE_MARGIN, ROLE_THRESHOLDS

    found = inspect_text("la la la la la la la la la la la la ole la la la la la")
    tokens = found.record.query_tokens
    share = sum(t == "ole" for t in tokens) / len(tokens)  # an even head's weight on the rare word (all keys visible)
    for r in found.roles:
        rare = r.scores["rare"]
        wanted = rare >= ROLE_THRESHOLDS["rare"] and rare - share >= ROLE_MARGIN
        assert ("rare" in r.labels) == wanted, (r.layer, r.head, rare)
        assert r.chance["rare"] == pytest.approx(share)
