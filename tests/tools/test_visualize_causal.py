"""``write_html`` / ``write_json`` with a causal model's role scores (``causal``), and their checks."""

from __future__ import annotations

import json
import re

import pytest
import torch

from multihead.models.gpt import GPT, GPTConfig
from multihead.tools import capture, causal_head_scores
from multihead.tools.visualize import write_html, write_json


@pytest.fixture(scope="module")
def gpt_view():
    from multihead.commands.inspect_causal import causal_view

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny")).eval()
    with torch.no_grad(), capture(model) as record:
        model(torch.tensor([[1, 2, 3]]))
    record.query_tokens = ["a", "b", "c"]
    return record, causal_view(causal_head_scores(model, vocab_size=256, length=4, batch=2))


def test_the_scores_go_into_the_page_and_heads_json(gpt_view, tmp_path):
    record, view = gpt_view
    page = write_html(record, tmp_path / "heads.html", causal=view).read_text()
    data = json.loads(re.search(r'id="mh-data">(.*?)</script>', page, re.S).group(1))
    saved = json.loads(write_json(record, tmp_path / "heads.json", causal=view).read_text())
    assert data["causal"] == saved["causal"] == json.loads(json.dumps(view))
    assert [r["name"] for r in view["roles"]] == ["induction", "previous_token", "duplicate_token", "copying"]
    plain = write_html(record, tmp_path / "plain.html").read_text()
    assert '"causal"' not in re.search(r'id="mh-data">(.*?)</script>', plain, re.S).group(1)


@pytest.mark.parametrize(
    "causal,error,message",
    [
        ("scores", TypeError, "causal must be a dict"),
        ({"roles": [], "scores": []}, TypeError, "causal needs a 'roles' list and a 'scores' dict"),
        ({"roles": [{"name": "induction"}], "scores": {}}, TypeError, "needs a str 'name' and 'meaning'"),
        (
            {"roles": [{"name": "induction", "meaning": "m"}], "scores": {}},
            ValueError,
            "causal role 'induction' has no scores",
        ),
    ],
)
def test_malformed_scores_are_refused_before_writing(gpt_view, tmp_path, causal, error, message):
    record, _ = gpt_view
    for writer in (write_html, write_json):
        with pytest.raises(error, match=message):
            writer(record, tmp_path / "out.file", causal=causal)
    assert list(tmp_path.iterdir()) == []
