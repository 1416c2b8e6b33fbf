"""``multihead inspect``: the head explorer on the real MiniLM and on a GPT checkpoint."""

from __future__ import annotations

import json

import pytest

from multihead.cli import main
from multihead.commands.inspect import DEFAULT_TEXT, inspect_text


@pytest.fixture(scope="module")
def minilm_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("inspect")
    return out, inspect_text(DEFAULT_TEXT)


def test_default_sentence_on_minilm(tmp_path, capsys):
    assert main(["inspect", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "all-MiniLM-L6-v2: 6 layers x 12 heads" in printed
    assert "[CLS] the law will never be perfect , but its application should be just . [SEP]" in printed
    assert "layer  head  roles" in printed and "strongest token links" in printed
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
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
