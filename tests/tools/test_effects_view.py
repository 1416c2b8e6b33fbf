"""The head-effects page in Chromium (playwright) and the PNG: signed colours, values on hover, text never run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from multihead.tools.effects_view import NEGATIVE, POSITIVE, cell_colour, write_effects_html, write_effects_png
from multihead.tools.head_effects import HeadEffects

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]  # fmt: skip
DANGEROUS = '<script>window.pwned=1</script><img src=x onerror="window.pwned=1">'
VALUES = [[0.5, -2.0, 0.0], [1.25, float("nan"), -0.125]]


def effects() -> HeadEffects:
    return HeadEffects(torch.tensor(VALUES, dtype=torch.float64), "patch", 3.0, -1.0, ["blocks.0.attn", DANGEROUS], [3, 2])


def rgb(style: str) -> tuple[int, ...]:
    inside = style.split("rgb(")[1].split(")")[0]
    return tuple(int(x) for x in inside.split(","))


def test_colours_are_signed_and_symmetric():
    assert cell_colour(2.0, 2.0) == POSITIVE and cell_colour(-2.0, 2.0) == NEGATIVE
    assert cell_colour(0.0, 2.0) == (255, 255, 255) and cell_colour(9.0, 2.0) == POSITIVE
    half_up, half_down = cell_colour(1.0, 2.0), cell_colour(-1.0, 2.0)
    assert half_up[0] > half_up[2] and half_down[2] > half_down[0] and min(half_up) > min(POSITIVE)


def test_the_png_draws_both_signs(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = write_effects_png(effects(), tmp_path / "effects.png", title=DANGEROUS)
    pixels = (imread(path)[..., :3] * 255).round().reshape(-1, 3).tolist()
    assert [*NEGATIVE] in pixels and [*POSITIVE] not in pixels  # -2.0 is the largest |effect|: full blue only
    for value in (1.25, 0.5, -0.125):  # the colour map has 256 steps: within one step's colour
        want = cell_colour(value, 2.0)
        assert any(max(abs(a - b) for a, b in zip(p, want)) <= 3 for p in pixels), value


def test_writers_refuse_what_they_cannot_draw(tmp_path):
    with pytest.raises(TypeError, match="effects must be a HeadEffects"):
        write_effects_html({"effects": VALUES}, tmp_path / "x.html")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_effects_html(effects(), tmp_path / "missing" / "x.html")


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")
def test_the_page_in_chromium(tmp_path):
    pytest.importorskip("playwright")
    from playwright.sync_api import sync_playwright

    path = write_effects_html(effects(), tmp_path / "effects.html", title=DANGEROUS, details={"clean prompt": DANGEROUS})
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1000, "height": 700})
        page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='true']", timeout=5000)
        cells = page.evaluate("""Array.from(document.querySelectorAll('#effects-grid td'), c =>
            [Number(c.dataset.layer), Number(c.dataset.head), c.dataset.effect, c.getAttribute('style'), c.innerText])""")
        assert len(cells) == 6
        for layer, head, effect, style, text in cells:
            want = VALUES[layer][head]
            if math.isnan(want):
                assert effect == "" and "rgb(" not in style and text == "\u2013"
                continue
            assert float(effect) == want and float(text) == pytest.approx(want, rel=1e-2)
            assert rgb(style) == cell_colour(want, 2.0)
        page.hover('#effects-grid td[data-layer="1"][data-head="0"]')
        assert page.inner_text("#readout") == f"layer 1, head 0 ({DANGEROUS}): +1.25"
        page.focus('#effects-grid td[data-layer="0"][data-head="1"]')
        assert page.inner_text("#readout") == "layer 0, head 1 (blocks.0.attn): -2"
        assert page.inner_text("#page-title") == DANGEROUS and DANGEROUS in page.inner_text("#details")
        assert page.inner_text("#scale-min") == "-2" and page.inner_text("#scale-max") == "+2"
        assert "minus the metric of the clean run (+3)" in page.inner_text("#meaning")
        assert page.evaluate("window.pwned") is None and page.locator("img").count() == 0
        assert page.evaluate("document.scripts.length") == 1
        browser.close()
    assert problems == []
