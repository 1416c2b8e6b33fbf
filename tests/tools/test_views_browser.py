"""The notebook views of Hugging Face models' output_attentions, drawn in Chromium (playwright):
two views on one page as Jupyter shows them (iframes), the drawn weights read back from the DOM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("playwright")
transformers = pytest.importorskip("transformers")
from playwright.sync_api import sync_playwright  # noqa: E402

from multihead.tools import head_view, model_view, rollout_view  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")

BERT_TOKENS = ["[CLS]", "the", "cat", "sat", "on", "it", "[SEP]"]
GPT_TOKENS = ["The", "\u0120cat", "\u0120sat", "\u0120on", "\u0120the", "\u0120mat"]
# every drawn line: its head, query, key and the weight it was drawn for
LINES = """Array.from(document.querySelectorAll('#hv-lines .hv-line'),
    l => [Number(l.dataset.head), Number(l.dataset.q), Number(l.dataset.k), Number(l.dataset.weight)])"""


@pytest.fixture(scope="module")
def outputs():
    """output_attentions of a tiny BertModel and GPT2Model built from configs (no download)."""
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=50, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=16, attn_implementation="eager")).eval()  # fmt: skip
    gpt = transformers.GPT2Model(transformers.GPT2Config(
        vocab_size=50, n_embd=24, n_layer=3, n_head=2, n_positions=16, attn_implementation="eager")).eval()  # fmt: skip
    with torch.no_grad():
        b = bert(input_ids=torch.randint(0, 50, (1, len(BERT_TOKENS))), output_attentions=True).attentions
        g = gpt(input_ids=torch.randint(0, 50, (1, len(GPT_TOKENS))), output_attentions=True).attentions
    assert len(b) == 2 and b[0].shape == (1, 4, 7, 7) and len(g) == 3 and g[0].shape == (1, 2, 6, 6)
    return b, g


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


def notebook_page(browser, tmp_path: Path, *views):
    """A page holding the views' _repr_html_ one after another, as a notebook's outputs are."""
    path = tmp_path / "notebook.html"
    body = "".join(f'<div class="output">{v._repr_html_()}</div>' for v in views)
    path.write_text(f"<!DOCTYPE html><html><body><h1>Notebook</h1>{body}</body></html>", encoding="utf-8")
    page = browser.new_page(viewport={"width": 1100, "height": 800})
    problems: list[str] = []
    page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(path.as_uri())
    frames = [page.frame_locator(f".output:nth-of-type({i + 1}) iframe") for i in range(len(views))]
    for frame in frames:
        frame.locator("body[data-ready='true']").wait_for(timeout=5000)
    page.problems = problems
    return page, [f for f in page.frames if f != page.main_frame]


def drawn(frame) -> dict[tuple[int, int, int], float]:
    """The head view's lines with the threshold at 0: every weight above 0 is drawn."""
    frame.evaluate("""() => { const s = document.getElementById('hv-threshold');
        s.value = '0'; s.dispatchEvent(new Event('input')); }""")
    return {(h, q, k): w for h, q, k, w in frame.evaluate(LINES)}


def want(weights: torch.Tensor) -> dict[tuple[int, int, int], float]:
    """[H, T, S] -> the weights the page draws: rounded to 4 digits, those above 0."""
    w = weights.double().round(decimals=4)
    return {(h, q, k): float(w[h, q, k]) for h, q, k in (w > 0).nonzero().tolist()}


def test_head_view_of_bert_and_model_view_of_gpt2_draw_the_tensors(browser, tmp_path, outputs):
    bert, gpt = outputs
    page, (hv, mv) = notebook_page(browser, tmp_path, head_view(bert, BERT_TOKENS, layer=1, heads="all"),
                                   model_view(gpt, GPT_TOKENS))  # fmt: skip
    try:
        assert hv.locator("#model-view").is_hidden() and mv.locator("#head-view").is_hidden()
        assert hv.locator("#hv-queries .hv-token").all_inner_texts() == BERT_TOKENS
        assert hv.get_attribute("#head-view", "data-heads") == "0,1,2,3" and hv.input_value("#hv-layer") == "1"
        got, expected = drawn(hv), want(bert[1][0])
        assert got.keys() == expected.keys()
        assert all(abs(got[key] - value) <= 1e-9 for key, value in expected.items())
        hv.select_option("#hv-layer", "0")  # another layer: its own weights
        got, expected = drawn(hv), want(bert[0][0])
        assert got.keys() == expected.keys() and all(abs(got[k] - v) <= 1e-9 for k, v in expected.items())

        cells = mv.locator(".mv-cell")
        assert cells.count() == 3 * 2
        mv.click('.mv-cell[data-layer="2"][data-head="1"]')  # a thumbnail opens that head below the grid
        assert mv.locator("#head-view").is_visible() and mv.get_attribute("#head-view", "data-heads") == "1"
        got, expected = drawn(mv), want(gpt[2][0, 1:2])
        assert {(q, k) for _, q, k in got} == {(q, k) for _, q, k in expected}  # causal: the upper triangle is 0
        assert all(q >= k for _, q, k in got)
        assert all(abs(got[(1, q, k)] - v) <= 1e-9 for (_, q, k), v in expected.items())
        # the thumbnails are the weights: pixel (q, k) of a cell's canvas is the colour of its weight
        pixel = mv.evaluate("""() => { const c = document.querySelector('.mv-cell[data-layer="0"][data-head="0"] canvas');
            return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data); }""")
        assert len(pixel) == 4 * 6 * 6 and pixel[4 * (0 * 6 + 1) : 4 * (0 * 6 + 1) + 3] == [68, 1, 84]  # weight 0
        # each frame grew to its page: nothing cut off, no scrolling inside the output
        for i, frame in enumerate((hv, mv)):
            inner = frame.evaluate("Math.ceil(document.body.getBoundingClientRect().height)")
            outer = page.evaluate(f"document.querySelectorAll('iframe')[{i}].getBoundingClientRect().height")
            assert outer >= inner
        assert page.problems == []
    finally:
        page.close()


def test_two_views_on_one_page_keep_their_own_state(browser, tmp_path, outputs):
    bert, _ = outputs
    page, (first, second) = notebook_page(browser, tmp_path, head_view(bert, BERT_TOKENS),
                                          head_view(bert, BERT_TOKENS, layer=1, heads=[2]))  # fmt: skip
    try:
        assert first.get_attribute("#head-view", "data-heads") == "0" and first.input_value("#hv-layer") == "0"
        assert second.get_attribute("#head-view", "data-heads") == "2" and second.input_value("#hv-layer") == "1"
        first.click('#hv-heads .hv-head-toggle[data-head="3"]')
        first.click('#hv-queries .hv-token[data-index="2"]')
        assert first.get_attribute("#head-view", "data-heads") == "0,3"
        assert second.get_attribute("#head-view", "data-heads") == "2"  # untouched
        assert second.get_attribute("#hv-canvas", "data-pinned") is None
        assert page.problems == []
    finally:
        page.close()


def test_cross_attention_and_rollout_views(browser, tmp_path, outputs):
    bert, _ = outputs
    g = torch.Generator().manual_seed(1)
    cross = tuple(torch.randn(1, 2, 3, 5, generator=g).softmax(-1) for _ in range(2))
    decoder, encoder = ["<s>", "le", "chat"], ["the", "cat", "sat", "down", "</s>"]
    from multihead.tools import attention_rollout

    page, (cv, rv) = notebook_page(browser, tmp_path, head_view(cross, decoder, key_tokens=encoder),
                                   rollout_view(bert, BERT_TOKENS))  # fmt: skip
    try:
        assert cv.locator("#hv-queries .hv-token").all_inner_texts() == decoder
        assert cv.locator("#hv-keys .hv-token").all_inner_texts() == encoder
        got, expected = drawn(cv), want(cross[0][0, :1])  # head 0, drawn first
        assert got.keys() == expected.keys()
        assert rv.locator(".hv-col-title.hv-left").inner_text().lower() == "outputs"
        got, expected = drawn(rv), want(attention_rollout(bert)[None])
        assert got.keys() == expected.keys() and all(abs(got[k] - v) <= 1e-9 for k, v in expected.items())
        assert page.problems == []
    finally:
        page.close()
