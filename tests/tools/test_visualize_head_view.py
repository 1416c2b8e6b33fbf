"""The head view in Chromium (playwright): page width, all heads overlaid, pinned tokens,
readable byte-level tokens, and a model view that fits or scrolls visibly, at 1280 and 900 px."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("playwright")
from playwright.sync_api import sync_playwright  # noqa: E402

from multihead.tools import AttentionRecord, LayerAttention  # noqa: E402
from multihead.tools.visualize import write_html  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")

# GPT-2's byte-level tokens: "Ġ" is a space, "Ċ" a newline, "Ã©" the two bytes of "é"
TOKENS = ["<|endoftext|>", "The", "Ġcat", "Ġsat", "Ċ", "Ġcaf", "Ã©", "!"]
SHOWN = ["<|endoftext|>", "The", "\u2423cat", "\u2423sat", "\u21b5", "\u2423caf", "\u00e9", "!"]
LINES = """Array.from(document.querySelectorAll('#hv-lines .hv-line'),
    l => [Number(l.dataset.head), Number(l.dataset.q), Number(l.dataset.k), l.getAttribute('stroke')])"""


def record_of(heads: int = 4, layer: int = 0, T: int = len(TOKENS), tokens=TOKENS) -> AttentionRecord:
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(1, heads, T, T, generator=g) * 3
    weights = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    return AttentionRecord([LayerAttention(layer, f"blocks.{layer}.attn", "mha", weights)], query_tokens=list(tokens))


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


def open_page(browser, path: Path, width: int):
    page = browser.new_page(viewport={"width": width, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='true']", timeout=5000)
    page.problems = problems
    return page


@pytest.mark.parametrize("width", [1280, 900])
def test_the_head_view_uses_the_page_width(browser, tmp_path, width):
    page = open_page(browser, write_html(record_of(), tmp_path / "h.html"), width)
    try:
        view = page.locator("#head-view").bounding_box()
        lines = page.locator("#hv-lines").bounding_box()
        assert view["width"] >= width - 80  # the panel spans the page (24 px margins)
        assert lines["width"] >= min(800, view["width"] - 300) and lines["x"] + lines["width"] <= view["x"] + view["width"]
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        page.set_viewport_size({"width": 700, "height": 900})  # the lines follow a resized window
        page.wait_for_function("(w) => document.getElementById('hv-lines').getBoundingClientRect().width < w",
                               arg=lines["width"])  # fmt: skip
        assert page.evaluate("document.documentElement.scrollWidth") <= 700
        assert page.problems == []
    finally:
        page.close()


def test_heads_of_a_layer_overlay_in_their_own_colours(browser, tmp_path):
    record = record_of(heads=4)
    page = open_page(browser, write_html(record, tmp_path / "h.html"), 1280)
    try:
        assert {head for head, *_ in page.evaluate(LINES)} == {0}
        page.click('#hv-heads .hv-head-toggle[data-head="2"]')
        drawn = page.evaluate(LINES)
        assert {head for head, *_ in drawn} == {0, 2} and page.get_attribute("#head-view", "data-heads") == "0,2"
        colours = {head: {c for h, _, _, c in drawn if h == head} for head in (0, 2)}
        assert len(colours[0]) == len(colours[2]) == 1 and colours[0] != colours[2]  # one colour per head
        for head in (0, 2):  # each head's lines are its own weights above the threshold
            w = record.layers[0].weights[0, head].double().round(decimals=4)
            want = sorted((i, j) for i, j in (w >= 0.01).nonzero().tolist())
            assert sorted((q, k) for h, q, k, _ in drawn if h == head) == want
        toggle = page.locator('#hv-heads .hv-head-toggle[data-head="2"]')
        assert toggle.get_attribute("aria-pressed") == "true"
        assert page.inner_text("#hv-title") == "Layer 0 \u00b7 Heads 0, 2"
        page.click("#hv-all")
        assert {head for head, *_ in page.evaluate(LINES)} == {0, 1, 2, 3}
        assert page.inner_text("#hv-title") == "Layer 0 \u00b7 all 4 heads" and page.input_value("#hv-head") == "all"
        for head in (0, 1, 2):
            page.click(f'#hv-heads .hv-head-toggle[data-head="{head}"]')
        page.click('#hv-heads .hv-head-toggle[data-head="3"]')  # the last head shown stays
        assert {head for head, *_ in page.evaluate(LINES)} == {3} and page.input_value("#hv-head") == "3"
        page.select_option("#hv-head", "1")  # the select shows one head again
        assert {head for head, *_ in page.evaluate(LINES)} == {1}
        assert page.problems == []
    finally:
        page.close()


def test_clicking_a_token_pins_its_links(browser, tmp_path):
    page = open_page(browser, write_html(record_of(), tmp_path / "h.html"), 1280)
    active = "Array.from(document.querySelectorAll('.hv-line.hv-active'), l => Number(l.dataset.q))"
    try:
        page.click('#hv-queries .hv-token[data-index="5"]')
        assert page.get_attribute("#hv-canvas", "data-pinned") == "query:5" and set(page.evaluate(active)) == {5}
        page.hover('#hv-queries .hv-token[data-index="3"]')  # hovering another token changes nothing
        page.hover("#hv-title")
        assert page.get_attribute("#hv-canvas", "data-focus") == "query:5" and set(page.evaluate(active)) == {5}
        page.click('#hv-heads .hv-head-toggle[data-head="1"]')  # still pinned after the drawing changes
        assert set(page.evaluate(active)) == {5} and page.get_attribute("#hv-canvas", "data-pinned") == "query:5"
        page.click('#hv-queries .hv-token[data-index="5"]')  # a second click lets go
        page.hover("#hv-title")
        assert page.get_attribute("#hv-canvas", "data-pinned") is None and page.evaluate(active) == []
        page.click('#hv-keys .hv-token[data-index="2"]')
        assert page.get_attribute("#hv-canvas", "data-pinned") == "key:2"
        page.keyboard.press("Escape")
        assert page.get_attribute("#hv-canvas", "data-pinned") is None
        assert page.problems == []
    finally:
        page.close()


def test_byte_level_tokens_show_spaces_and_bytes_readably(browser, tmp_path):
    page = open_page(browser, write_html(record_of(), tmp_path / "h.html"), 1280)
    try:
        for side in ("queries", "keys"):
            tokens = page.locator(f"#hv-{side} .hv-token")
            assert tokens.all_inner_texts() == SHOWN
            assert [tokens.nth(i).get_attribute("title") for i in range(len(TOKENS))] == TOKENS  # raw token on hover
        assert page.problems == []
    finally:
        page.close()


def test_a_single_layer_is_named_by_its_number(browser, tmp_path):
    page = open_page(browser, write_html(record_of(heads=1, layer=4), tmp_path / "h.html"), 900)
    try:
        assert page.inner_text("#hv-title") == "Layer 4 \u00b7 Head 0"
        assert "Call" not in page.inner_text("body")
        assert "layer 4 \u00d7 1 head \u00b7 8 queries, 8 keys" in page.inner_text("#summary")
    finally:
        page.close()


def test_a_model_view_too_wide_for_900px_scrolls_and_says_so(browser, tmp_path):
    record = record_of(heads=30)
    page = open_page(browser, write_html(record, tmp_path / "h.html"), 900)
    try:
        width = page.evaluate("[document.getElementById('mv-grid').scrollWidth, document.getElementById('mv-grid').clientWidth]")
        assert width[0] > width[1] and page.locator("#mv-scroll").is_visible()
        assert page.evaluate("document.documentElement.scrollWidth") <= 900  # the grid scrolls, not the page
        page.eval_on_selector("#mv-grid", "g => { g.scrollLeft = g.scrollWidth; }")
        page.locator('.mv-cell[data-head="29"]').click()
        assert page.get_attribute("#head-view", "data-head") == "29"
    finally:
        page.close()


def test_the_demo_page_states_the_rule_both_marks_and_the_masses(browser, tmp_path):
    """``make demo``'s command, one layer: the page's legend matches its table and the terminal's."""
    from multihead.cli import main
    from multihead.tools.roles import MARKS, RULE, SCORE_MEANINGS

    assert main(["inspect", "The law will never be perfect, but its application should be just.", "--layer", "0",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    page = open_page(browser, tmp_path / "heads.html", 1280)
    try:
        terms = page.evaluate("Array.from(document.querySelectorAll('#role-legend dt'), d => d.firstChild.textContent)")
        columns = page.evaluate("Array.from(document.querySelectorAll('#role-table th'), t => t.dataset.column)")
        assert terms == ["roles", *columns[3:], "previous_mass", "self_mass", "next_mass"], terms
        legend = page.inner_text("#role-legend")
        assert RULE in legend and MARKS in legend
        for name in ("previous_mass", "self_mass", "next_mass"):
            assert SCORE_MEANINGS[name] in legend
        assert legend.count("head view only, not in the table") == 3
        assert page.get_attribute('#role-table th[data-column="roles"]', "title") == f"{RULE}; {MARKS}"
        labels = page.evaluate("Array.from(document.querySelectorAll('#role-table tbody tr td:nth-child(3)'), t => t.innerText)")
        assert "-" not in labels and "\u2013" not in labels  # a head without a role says "none"
        assert page.inner_text("#hv-title") == "Layer 0 \u00b7 Head 0" and page.problems == []
    finally:
        page.close()
