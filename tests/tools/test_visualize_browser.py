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
        assert view.page.locator("#hv-head option").count() == 4 + 2  # each head, "All heads", "Chosen heads"
        assert view.page.locator("#hv-heads .hv-head-toggle").count() == 4  # one colour toggle per head
        view.assert_clean()
    finally:
        view.page.close()


# -- role table: legend, sorting; notices; readable weight labels; narrow windows ----------------

SORT_ROLES = [  # one role per head of record_of((3, 3)); "rare" is missing (not measurable) on two heads
    {"layer": 0, "head": 0, "labels": ["previous"], "scores": {"previous": 0.95, "broad": 0.20, "rare": 0.1}},
    {"layer": 0, "head": 1, "labels": [], "scores": {"previous": 0.10, "broad": 0.55}},
    {"layer": 0, "head": 2, "labels": ["broad"], "scores": {"previous": 0.30, "broad": 0.91, "rare": 0.4}},
    {"layer": 1, "head": 0, "labels": [], "scores": {"previous": 0.00, "broad": 0.35, "rare": 0.2}},
    {"layer": 1, "head": 1, "labels": ["broad"], "scores": {"previous": 0.50, "broad": 0.85}},
    {"layer": 1, "head": 2, "labels": [], "scores": {"previous": 0.20, "broad": 0.05, "rare": 0.3}},
]
TABLE = """() => Array.from(document.querySelectorAll('#role-table tbody tr'), tr =>
    [Number(tr.dataset.layer), Number(tr.dataset.head)])"""


def _legend():
    from multihead.tools.roles import role_legend

    return {name: {"meaning": meaning, "threshold": limit} for name, meaning, limit in role_legend()}


@pytest.fixture
def role_viewer(browser, tmp_path):
    notices = ["the text is 300 tokens: only the first 256 were analysed", "<b>3 of 4</b> words became [UNK]"]
    path = write_html(record_of((3, 3)), tmp_path / "roles.html", roles=SORT_ROLES, legend=_legend(), notices=notices)
    view = Viewer(browser, path)
    view.notices = notices
    yield view
    view.page.close()


def expected_order(column, descending):
    """(layer, head) rows sorted by a score, missing scores last, ties in (layer, head) order."""
    present = [r for r in SORT_ROLES if column in r["scores"]]
    missing = [r for r in SORT_ROLES if column not in r["scores"]]
    present.sort(key=lambda r: (-r["scores"][column] if descending else r["scores"][column], r["layer"], r["head"]))
    return [[r["layer"], r["head"]] for r in present + missing]


def test_role_table_sorts_by_the_clicked_column(role_viewer):
    page = role_viewer.page
    in_order = [[r["layer"], r["head"]] for r in SORT_ROLES]
    assert page.evaluate(TABLE) == in_order
    for column in ("broad", "rare", "previous"):
        page.click(f'#role-table th[data-column="{column}"] button')
        assert page.get_attribute(f'#role-table th[data-column="{column}"]', "aria-sort") == "descending"
        assert page.evaluate(TABLE) == expected_order(column, descending=True), column
        page.click(f'#role-table th[data-column="{column}"] button')
        assert page.get_attribute(f'#role-table th[data-column="{column}"]', "aria-sort") == "ascending"
        assert page.evaluate(TABLE) == expected_order(column, descending=False), column
        assert page.locator("#role-table th[aria-sort]").count() == 1
    page.click('#role-table th[data-column="layer"] button')
    assert page.evaluate(TABLE) == in_order
    page.click('#role-table th[data-column="layer"] button')
    assert page.evaluate(TABLE) == in_order[::-1]  # by layer, then head, both descending
    page.click('#role-table tbody tr:first-child')  # rows still open their head after sorting
    assert role_viewer.selection()[:2] == (1, 2)
    role_viewer.assert_clean()


def test_headers_and_legend_give_each_score_its_meaning_and_threshold(role_viewer):
    from multihead.tools.roles import ROLE_THRESHOLDS, SCORE_MEANINGS

    page = role_viewer.page
    for column in ("previous", "broad", "rare"):
        title = page.get_attribute(f'#role-table th[data-column="{column}"]', "title")
        assert SCORE_MEANINGS[column] in title and f"{ROLE_THRESHOLDS[column]:.2f}" in title, title
    for column in ("layer", "head", "roles"):
        assert len(page.get_attribute(f'#role-table th[data-column="{column}"]', "title")) > 10
    legend = page.inner_text("#role-legend")
    for column in ("previous", "broad", "rare"):
        assert SCORE_MEANINGS[column] in legend and f"\u2265 {ROLE_THRESHOLDS[column]:.2f}" in legend
    terms = page.evaluate("Array.from(document.querySelectorAll('#role-legend dt'), d => d.firstChild.textContent)")
    assert terms == ["previous", "broad", "rare"]  # the columns the table shows, in its order
    role_viewer.assert_clean()


def test_notices_are_shown_as_text_at_the_top(role_viewer, viewer):
    notes = role_viewer.page.locator("#notices .notice")
    assert notes.count() == 2 and role_viewer.page.locator("#notices").is_visible()
    assert notes.all_inner_texts() == role_viewer.notices  # "<b>" shown literally, not parsed
    assert role_viewer.page.locator("#notices b").count() == 0
    assert viewer.page.locator("#notices").is_hidden()  # no notices, no box
    role_viewer.assert_clean()


def _relative_luminance(rgb):
    def channel(v):
        v /= 255
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(v) for v in rgb)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _contrast(a, b):
    la, lb = sorted((_relative_luminance(a), _relative_luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


SHADED = """async () => {
  const rgb = (s) => s.match(/[\\d.]+/g).map(Number);
  const found = [];
  const heads = document.querySelectorAll('#hv-heads .hv-head-toggle').length;
  for (let h = 0; h < heads; h++) {
    const box = document.getElementById('hv-head');
    box.value = String(h);
    box.dispatchEvent(new Event('change'));
    for (const side of ['queries', 'keys']) {
      for (const token of document.querySelectorAll('#hv-' + side + ' .hv-token')) {
        token.dispatchEvent(new Event('mouseenter'));
        const other = side === 'queries' ? '#hv-keys' : '#hv-queries';
        const pseudo = side === 'queries' ? '::after' : '::before';
        for (const node of document.querySelectorAll(other + ' .hv-token[data-weight]')) {
          found.push({head: h, weight: Number(node.dataset.weight), bg: rgb(getComputedStyle(node).backgroundColor),
                      text: rgb(getComputedStyle(node).color), label: rgb(getComputedStyle(node, pseudo).color),
                      content: getComputedStyle(node, pseudo).content});
        }
        token.dispatchEvent(new Event('mouseleave'));
      }
    }
  }
  return found;
}"""


def test_weight_labels_are_readable_on_every_chip_colour(browser, tmp_path):
    """Token text and its weight label against the shaded chip (composited on the white panel):
    WCAG contrast >= 4.5 for every head colour, from faint to fully dark chips."""
    T, H = 5, 12
    weights = torch.zeros(1, H, T, T)
    for i in range(T):  # row i: one key with weight 1 - i/10 (dark), the rest spread (light)
        weights[0, :, i, i] = 1.0 - 0.1 * i
        weights[0, :, i, :i] = 0.1 * i / max(i, 1)
    from multihead.tools import AttentionRecord, LayerAttention

    record = AttentionRecord([LayerAttention(0, "attn", "mha", weights)], query_tokens=list("abcde"))
    view = Viewer(browser, write_html(record, tmp_path / "chips.html"))
    try:
        chips = view.page.evaluate(SHADED)
        assert {c["head"] for c in chips} == set(range(H))
        dark = 0
        for c in chips:
            r, g, b, alpha = c["bg"]
            bg = [alpha * v + (1 - alpha) * 255 for v in (r, g, b)]  # over the white panel
            dark += _relative_luminance(bg) < 0.18
            assert c["label"] == c["text"] and c["content"] == f'"{c["weight"]:.2f}"', c
            assert _contrast(bg, c["text"][:3]) >= 4.5, c
        assert dark >= H  # the check covers dark chips, where fixed dark text was unreadable
        view.assert_clean()
    finally:
        view.page.close()


OVERFLOW = """() => {
  const W = document.documentElement.clientWidth, bad = [];
  const scrolls = (e) => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX);
  for (const e of document.body.querySelectorAll('*')) {
    const r = e.getBoundingClientRect();
    if ((r.width === 0 && r.height === 0) || (r.left >= -0.5 && r.right <= W + 0.5)) continue;
    let p = e.parentElement, inside = false;
    while (p && p !== document.body && !inside) {
      const pr = p.getBoundingClientRect();
      inside = scrolls(p) && pr.left >= -0.5 && pr.right <= W + 0.5;
      p = p.parentElement;
    }
    if (!inside) bad.push(e.tagName + '#' + e.id + '.' + e.getAttribute('class') + ' right=' + r.right);
  }
  const grid = document.getElementById('mv-grid');
  return {bad: bad, page: document.documentElement.scrollWidth, width: W,
          grid: [grid.scrollWidth, grid.clientWidth]};
}"""


def test_nothing_overflows_a_900px_window_outside_a_scroll_container(browser, tmp_path):
    """MiniLM's shape (6 layers x 12 heads), long tokens, a long title and notice, at 900 px:
    all 12 heads of a layer fit the model view, none is cut off."""
    tokens = ["[CLS]", "Pneumonoultramicroscopicsilicovolcanoconiosis" * 2, *"abcdefghijklm", "[SEP]"]
    g = torch.Generator().manual_seed(0)
    from multihead.tools import AttentionRecord, LayerAttention

    layers = [
        LayerAttention(i, f"encoder.layers.{i}.attention", "mha", torch.randn(1, 12, 16, 16, generator=g).softmax(-1))
        for i in range(6)
    ]
    record = AttentionRecord(layers, query_tokens=tokens, source="all-MiniLM-L6-v2")
    roles = [{"layer": i, "head": h, "labels": ["cls", "broad"], "scores": {"cls": 0.6, "broad": 0.85}}
             for i in range(6) for h in range(12)]  # fmt: skip
    title = "all-MiniLM-L6-v2: " + "Averylongwordwithoutanyspace" * 8
    path = write_html(record, tmp_path / "wide.html", roles=roles, title=title, legend=_legend(),
                      notices=["x" * 300])  # fmt: skip
    page = browser.new_page(viewport={"width": 900, "height": 900})
    try:
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='true']", timeout=5000)
        found = page.evaluate(OVERFLOW)
        assert found["bad"] == [] and found["page"] <= found["width"] == 900, found
        assert found["grid"][0] <= found["grid"][1], found  # the 12 heads fit: nothing to scroll to
        grid = page.locator("#mv-grid").bounding_box()
        for cell in page.locator('.mv-cell[data-layer="5"]').all():
            box = cell.bounding_box()
            assert grid["x"] <= box["x"] and box["x"] + box["width"] <= grid["x"] + grid["width"] + 0.5, box
        assert page.locator("#mv-scroll").is_hidden()
        page.locator('.mv-cell[data-layer="5"][data-head="11"]').click()  # the last head, in view, opens
        assert page.get_attribute("#head-view", "data-head") == "11"
    finally:
        page.close()
