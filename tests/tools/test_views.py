"""The notebook views without a browser: what a page holds, save(), the inline frame, and mistakes as one line."""

from __future__ import annotations

import html
import json
import re

import pytest
import torch

from multihead.tools import AttentionRecord, AttentionView, LayerAttention, head_view, model_view, rollout_view

TOKENS = ["[CLS]", "the", "cat", "sat", "[SEP]"]
ATOL = 6e-5  # the page holds weights rounded to 4 digits: within 5e-5, plus float32 rounding


def attentions(L: int = 2, H: int = 3, T: int = 5, S: int | None = None, B: int = 1) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, T, S or T, generator=g).softmax(-1) for _ in range(L))


def page_data(view: AttentionView) -> dict:
    text = re.search(r'<script type="application/json" id="mh-data">(.*?)</script>', view.html, re.S).group(1)
    return json.loads(text)


def srcdoc(view: AttentionView) -> str:
    return html.unescape(re.fullmatch(r'<iframe [^>]*srcdoc="([^"]*)"></iframe>', view._repr_html_()).group(1))


def test_the_inline_frame_holds_the_saved_page(tmp_path):
    view = head_view(attentions(), TOKENS)
    path = view.save(tmp_path / "head.html")
    assert path.read_text(encoding="utf-8") == view.html == srcdoc(view)
    assert [p.name for p in tmp_path.iterdir()] == ["head.html"]  # no temporary file left behind
    assert 'class="multihead-view"' in view._repr_html_()
    # offline: no address to fetch anything from, the script and style are in the page
    assert not re.search(r"(src|href)=\"(https?:)?//", view.html) and "<script src" not in view.html
    assert "default-src 'none'" in view.html


def test_a_hugging_face_tuple_becomes_the_pages_data():
    weights = attentions(L=3, H=2, B=2)
    data = page_data(model_view(weights, TOKENS, batch=1, layers=[0, 2]))
    assert data["view"] == "model" and data["query_tokens"] == TOKENS and data["key_tokens"] == TOKENS
    assert [layer["layer"] for layer in data["layers"]] == [0, 2]
    for layer, position in zip(data["layers"], (0, 2)):
        torch.testing.assert_close(torch.tensor(layer["weights"]), weights[position][1], atol=ATOL, rtol=0)


def test_half_precision_and_numpy_layers_are_read_as_float32():
    weights = attentions(L=2)
    data = page_data(model_view([weights[0].bfloat16(), weights[1].numpy()], TOKENS))
    torch.testing.assert_close(torch.tensor(data["layers"][0]["weights"]), weights[0][0].bfloat16().float(), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(data["layers"][1]["weights"]), weights[1][0], atol=ATOL, rtol=0)


def test_head_view_starts_on_the_layer_and_heads_asked_for():
    data = page_data(head_view(attentions(L=3), TOKENS, layers=iter([1, 2]), layer=2, heads=[2, 0]))
    assert data["view"] == "head" and data["start"] == {"row": 1, "heads": [0, 2]}
    assert page_data(head_view(attentions(), TOKENS, heads="all"))["start"] == {"row": 0, "heads": [0, 1, 2]}


def test_cross_attention_takes_the_key_tokens():
    keys = ["a", "b", "c", "d", "e", "f", "g"]
    data = page_data(head_view(attentions(T=5, S=7), TOKENS, key_tokens=keys))
    assert data["query_tokens"] == TOKENS and data["key_tokens"] == keys
    assert data["layers"][0]["kind"] == "cross"


def test_a_record_and_padding():
    weights = attentions(L=1, B=2)[0]
    record = AttentionRecord([LayerAttention(0, "enc.0", "mha", weights)], query_tokens=TOKENS, source="tiny")
    data = page_data(head_view(record))
    assert data["query_tokens"] == TOKENS and data["source"] == "tiny"
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    data = page_data(head_view(record, [TOKENS, TOKENS[:3] + ["[PAD]", "[PAD]"]], batch=1, attention_mask=mask))
    assert data["query_tokens"] == TOKENS[:3]
    torch.testing.assert_close(torch.tensor(data["layers"][0]["weights"]), weights[1, :, :3, :3], atol=ATOL, rtol=0)


def test_rollout_view_rows_are_the_methods():
    from multihead.tools import attention_flow, attention_rollout

    weights = attentions(L=3)
    data = page_data(rollout_view(weights, TOKENS, methods=("rollout", "flow")))
    assert data["row_titles"] == ["Rollout", "Flow"] and data["sides"] == ["outputs", "inputs"]
    for layer, want in zip(data["layers"], (attention_rollout(weights), attention_flow(weights))):
        torch.testing.assert_close(torch.tensor(layer["weights"][0], dtype=torch.float64), want, atol=ATOL, rtol=0)


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and "Traceback" not in message
    return message


@pytest.mark.parametrize(
    "call,error,words",
    [
        (lambda: head_view((torch.rand(1, 2, 5, 5), torch.rand(1, 2, 4, 4)), TOKENS), ValueError,
         "attentions[1] is [1, 2, 4, 4] but attentions[0] has B=1, T=5, S=5"),
        (lambda: head_view(attentions(), TOKENS[:4]), ValueError, "tokens has 4 strings but the attentions have T=5"),
        (lambda: head_view(attentions(T=5, S=7), TOKENS), ValueError, "pass key_tokens="),
        (lambda: head_view(attentions(T=5, S=7), TOKENS, key_tokens=["x"]), ValueError,
         "key_tokens has 1 strings but the attentions have S=7"),
        (lambda: head_view((torch.rand(1, 2, 5, 5), torch.rand(1, 2, 5, 5).index_put_((torch.tensor(0),
         torch.tensor(1), torch.tensor(3), torch.tensor(2)), torch.tensor(float("nan"))))), ValueError,
         "attentions[1] has a non-finite weight (nan) at head 1, query 3, key 2"),
        (lambda: head_view(torch.rand(2, 1, 2, 5, 5), TOKENS), TypeError, "tuple or list"),
        (lambda: head_view([torch.rand(2, 5, 5, 1, 1)], TOKENS), ValueError, "[B, H, T, S]"),
        (lambda: head_view([torch.ones(1, 2, 5, 5, dtype=torch.long)], TOKENS), TypeError, "floats"),
        (lambda: head_view(attentions(), "the cat"), TypeError, "tokens must be a list of str"),
        (lambda: head_view(attentions(), TOKENS[:4] + [5]), TypeError, "tokens[4]"),
        (lambda: head_view(attentions(), TOKENS, layer=1, layers=[0]), ValueError, "layer=1 is not shown"),
        (lambda: head_view(attentions(), TOKENS, heads=[3]), ValueError, "heads 0..2"),
        (lambda: head_view(attentions(), TOKENS, layers=[2]), ValueError, "layers has 2"),
        (lambda: model_view(attentions(), TOKENS, batch=1), ValueError, "batch=1"),
        (lambda: model_view((), TOKENS), ValueError, "attn_implementation='eager'"),  # what sdpa returns
        (lambda: model_view(None, TOKENS), TypeError, "output_attentions=True"),
        (lambda: rollout_view(attentions(), TOKENS, methods=("flows",)), ValueError, "methods"),
    ],
)
def test_mistakes_are_one_line(call, error, words):
    with pytest.raises(error) as excinfo:
        call()
    assert words in one_line(excinfo)


def test_save_refuses_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError) as excinfo:
        head_view(attentions(), TOKENS).save(tmp_path / "nowhere" / "h.html")
    assert "does not exist" in one_line(excinfo)
