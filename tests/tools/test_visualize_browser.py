"""The HTML viewer in a real browser: Debian's Chromium driven by playwright.

Needs ``pip install playwright`` (its bundled driver only; browsers are never
downloaded) and ``apt-get install chromium``; ``make`` installs both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("playwright")
from playwright.sync_api import sync_playwright  # noqa: E402

from multihead import MultiHeadAttention  # noqa: E402
from multihead.tools import capture  # noqa: E402
from multihead.tools.visualize import write_html  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")

DANGEROUS = ["<script>alert(1)</script>", '"quoted"', "</script>", '<img src=x onerror="window.pwned=1">']
TOKENS = ["<s>", "The", *DANGEROUS, "cat", " sat", "on", "the", "mat", "."]
ROLES = [
    {"layer": 0, "head": 0, "labels": ["previous"], "scores": {"previous": 0.93, "broad": 0.21}},
    {"layer": 0, "head": 1, "labels": [], "scores": {"previous": 0.1, "broad": 0.4}},
    {"layer": 1, "head": 2, "labels": ["broad", "<b>bold</b>"], "scores": {"previous": 0.05, "broad": 0.88}},
]
LINES = """Array.from(document.querySelectorAll('#hv-lines .hv-line'),
    l => [Number(l.dataset.q), Number(l.dataset.k), Number(l.dataset.weight)])"""


class Stack(nn.Module):
    def __init__(self, num_heads):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([MultiHeadAttention(12, h) for h in num_heads])

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x, is_causal=True)
        return x


def record_of(num_heads):
    model = Stack(num_heads).eval()
    with torch.no_grad(), capture(model) as record:
        model(torch.randn(1, len(TOKENS), 12) * 3)
    record.query_tokens = list(TOKENS)
    return record


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield chromium
        chromium.close()


class Viewer:
    """A page with every console error, page error and dialog recorded."""

    def __init__(self, browser, path: Path):
        self.problems: list[str] = []
        self.dialogs: list[str] = []
        self.page = browser.new_page(viewport={"width": 1280, "height": 900})
        self.page.on("console", lambda m: m.type in ("error", "warning") and self.problems.append(f"{m.type}: {m.text}"))
        self.page.on("pageerror", lambda e: self.problems.append(f"pageerror: {e}"))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.page.goto(path.as_uri())
        self.page.wait_for_selector("body[data-ready='true']", timeout=5000)

    def lines(self):
        return self.page.evaluate(LINES)

    def selection(self):
        hv = self.page.locator("#head-view")
        return int(hv.get_attribute("data-layer")), int(hv.get_attribute("data-head")), self.page.inner_text("#hv-title")

    def assert_clean(self):
        assert self.problems == [] and self.dialogs == [] and self.page.evaluate("window.pwned") is None


@pytest.fixture
def viewer(browser, tmp_path):
    record = record_of((3, 3))
    path = write_html(record, tmp_path / "heads.html", roles=ROLES, title='Two layers <b>"3 heads"</b>')
    view = Viewer(browser, path)
    view.record, view.dir = record, tmp_path
    yield view
    view.page.close()


def expected_lines(record, layer, head, threshold):
    w = record.layers[layer].weights[0, head].double().round(decimals=4)
    return sorted((i, j) for i, j in (w >= threshold).nonzero().tolist() if w[i, j] > 0)


def test_dangerous_text_is_shown_literally_and_never_run(viewer):
    text = viewer.page.inner_text("body")
    for token in DANGEROUS:
        assert token in text
    assert viewer.page.inner_text("#page-title") == 'Two layers <b>"3 heads"</b>'
    assert "<b>bold</b>" in viewer.page.inner_text("#role-table")
    scripts = viewer.page.evaluate("Array.from(document.scripts, s => s.id || s.type || 'viewer')")
    assert scripts == ["mh-data", "viewer"]
    assert viewer.page.locator("img, b:not(.mv-label b), iframe, object").count() == 0
    viewer.assert_clean()


def test_model_view_cells_open_their_head(viewer):
    cells = viewer.page.locator(".mv-cell")
    assert cells.count() == 2 * 3
    assert viewer.page.locator(".mv-heat").count() == 6
    assert viewer.selection() == (0, 0, "Layer 0 \u00b7 Head 0")
    before = viewer.lines()
    assert sorted((q, k) for q, k, _ in before) == expected_lines(viewer.record, 0, 0, 0.01)

    viewer.page.click('.mv-cell[data-layer="1"][data-head="2"]')
    assert viewer.selection() == (1, 2, "Layer 1 \u00b7 Head 2")
    after = viewer.lines()
    assert after != before
    assert sorted((q, k) for q, k, _ in after) == expected_lines(viewer.record, 1, 2, 0.01)
    selected = viewer.page.locator(".mv-cell.selected")
    assert selected.count() == 1 and selected.get_attribute("data-layer") == "1"
    assert selected.get_attribute("aria-pressed") == "true"
    assert "broad" in selected.inner_text() and "broad" in viewer.page.inner_text("#hv-roles")

    viewer.page.click('#role-table tr[data-layer="0"][data-head="1"]')  # the role table opens heads too
    assert viewer.selection()[:2] == (0, 1)
    viewer.page.select_option("#hv-layer", "1")
    assert viewer.selection()[:2] == (1, 1)
    viewer.assert_clean()


def test_hovering_a_token_highlights_its_links(viewer):
    page = viewer.page
    assert page.locator("#hv-canvas.hv-focus").count() == 0
    query = 5
    page.hover(f'#hv-queries .hv-token[data-index="{query}"]')
    assert page.get_attribute("#hv-canvas", "data-focus") == f"query:{query}"
    active = page.evaluate("Array.from(document.querySelectorAll('.hv-line.hv-active'), l => Number(l.dataset.q))")
    assert active and set(active) == {query}
    assert len(active) == sum(1 for q, _, _ in viewer.lines() if q == query)
    shaded = page.locator("#hv-keys .hv-token[data-weight]")
    row = viewer.record.layers[0].weights[0, 0, query].double().round(decimals=4)
    assert shaded.count() == int((row > 0).sum()) and int((row[query + 1 :] > 0).sum()) == 0  # causal
    page.screenshot(path=str(viewer.dir / "heads.png"), full_page=True)
    print(f"\nscreenshot: {viewer.dir / 'heads.png'}")

    page.hover('#hv-keys .hv-token[data-index="0"]')
    keys = page.evaluate("Array.from(document.querySelectorAll('.hv-line.hv-active'), l => Number(l.dataset.k))")
    assert keys and set(keys) == {0}
    page.hover("#hv-title")
    assert page.locator("#hv-canvas.hv-focus, .hv-line.hv-active, .hv-token[data-weight]").count() == 0
    assert (viewer.dir / "heads.png").stat().st_size > 20_000
    viewer.assert_clean()


def test_threshold_slider_hides_weak_links(viewer):
    viewer.page.eval_on_selector("#hv-threshold", "e => { e.value = '0.3'; e.dispatchEvent(new Event('input')); }")
    assert viewer.page.inner_text("#hv-threshold-value") == "0.30"
    lines = viewer.lines()
    assert lines and min(w for _, _, w in lines) >= 0.3
    assert sorted((q, k) for q, k, _ in lines) == expected_lines(viewer.record, 0, 0, 0.3)
    viewer.assert_clean()


def test_page_without_roles_and_uneven_heads(browser, tmp_path):
    view = Viewer(browser, write_html(record_of((2, 4)), tmp_path / "plain.html"))
    try:
        assert view.page.locator(".mv-cell").count() == 6 and view.page.locator(".mv-empty").count() == 2
        assert view.page.locator("#roles").is_hidden()
        view.page.click('.mv-cell[data-layer="1"][data-head="3"]')
        assert view.selection()[:2] == (1, 3)
        assert view.page.locator("#hv-head option").count() == 4
        view.assert_clean()
    finally:
        view.page.close()
