"""The page ``multihead inspect --corpus`` writes, in Debian's Chromium driven by playwright:
the role table's cells are each head's mean ± sd over the lines with their evidence, the views the main text's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli import quietly

from multihead.models.checkpoint import save_checkpoint
from multihead.models.gpt import GPT, GPTConfig

pytest.importorskip("matplotlib")
pytest.importorskip("playwright")
from playwright.sync_api import sync_playwright  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"]
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")

CELLS = """() => Array.from(document.querySelectorAll('#role-table tbody tr'), tr =>
    Array.from(tr.querySelectorAll('td'), td => [td.dataset.column || null, td.textContent, td.title,
                                                 td.classList.contains('thin')]))"""


def fmt(x: float) -> str:
    """The page's number format."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


@pytest.fixture(scope="module")
def page_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus_page")
    torch.manual_seed(0)
    save_checkpoint(GPT(GPTConfig.from_preset("tiny")), folder / "ckpt")
    corpus = folder / "lines.txt"
    corpus.write_text("to be, or not to be\nthat is the question\nwhether tis nobler in the mind to suffer\nay\n",
                      encoding="utf-8")  # fmt: skip
    out = folder / "out"
    rc, _, err = quietly("inspect", "all the world", "--corpus", str(corpus), "--checkpoint", str(folder / "ckpt"),
                         "--out", str(out))  # fmt: skip
    assert rc == 0, err
    return out


def test_the_role_table_shows_mean_spread_and_evidence_and_the_views_show_the_main_text(page_files):
    roles = json.loads((page_files / "heads.json").read_text())["roles"]
    # punctuation is in one line only: too little evidence, marked on the page
    assert all(r["evidence"]["punct"]["enough"] is False for r in roles) and any(r["labels"] for r in roles)
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto((page_files / "heads.html").as_uri())
        page.wait_for_selector("body[data-ready='true']", timeout=5000)
        headers = page.evaluate("Array.from(document.querySelectorAll('#role-table th'), th => th.dataset.column)")
        assert headers[:4] == ["layer", "head", "roles", "texts"]
        assert "texts of the corpus that measured the head" in page.get_attribute('#role-table th[data-column="texts"]', "title")
        rows = page.evaluate(CELLS)
        assert len(rows) == len(roles) == 8
        for role, cells in zip(roles, rows):
            assert cells[3][1] == str(role["texts"])
            assert cells[2][1] == ("".join(role["labels"]) or "none")
            for column, text, title, thin in cells[4:]:
                mean, sd, ev = role["scores"].get(column), role["spread"].get(column), role["evidence"].get(column)
                if mean is None:
                    assert text == "-"
                    continue
                want = fmt(mean) + (f" \u00b1 {fmt(sd)}" if sd is not None else "")
                assert text == want + ("*" if ev["enough"] is False else ""), (column, text)
                assert thin == (ev["enough"] is False)
                assert title.startswith(f"mean over {ev['texts']} text" + ("s" if ev["texts"] != 1 else "")), title
                assert f"{ev['rows']} query row" in title
        tokens = page.evaluate("Array.from(document.querySelectorAll('#hv-queries .hv-token'), t => t.textContent)")
        assert "".join(tokens).replace("\u2423", " ") == "all the world"
        assert "roles over 4 texts of lines.txt" in page.inner_text("#page-title")
        page.click('#role-table th[data-column="texts"] button')  # sorting by the evidence works too
        page.click('#role-table tbody tr:first-child')
        assert "\u00b1" in page.inner_text("#hv-roles")  # the head view lists the head's mean ± sd
        browser.close()
    assert problems == []


def test_a_withheld_role_is_shown_beside_the_roles(tmp_path):
    from multihead.tools.capture import AttentionRecord, LayerAttention
    from multihead.tools.corpus_roles import score_records
    from multihead.tools.visualize import write_html

    tokens = ["[CLS]", "a", ",", "c", "d", "[SEP]"]
    w = torch.full((1, 2, 6, 6), 0.02)
    w[..., 2] = 0.9  # both heads on the one comma of the one text
    records = [AttentionRecord([LayerAttention(0, "attn", "mha", w)], query_tokens=tokens)]
    found = score_records(records)
    assert [h.withheld for h in found.heads] == [["punct"], ["punct"]]
    path = write_html(records[0], tmp_path / "heads.html", roles=[h.to_dict() for h in found.heads])
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        page = browser.new_page()
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='true']", timeout=5000)
        rows = page.evaluate(CELLS)
        assert [cells[2][1] for cells in rows] == ["none (punct)", "none (punct)"]
        punct = next(cell for cell in rows[0] if cell[0] == "punct")
        assert punct[1] == "0.90*" and punct[3] and "too little evidence for the role" in punct[2]
        browser.close()
