"""head_view in a real notebook: built with nbformat, executed and rendered by `jupyter nbconvert --to html
--execute`; the rendered page holds the view's frame, no error output, and the frame draws in Chromium."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbconvert")
pytest.importorskip("ipykernel")
pytestmark = pytest.mark.slow  # a kernel starts: about 15 s on two busy cores

SRC = Path(__file__).resolve().parents[2] / "src"
CHROMIUM = Path("/usr/bin/chromium")
CELLS = [
    "import torch\nfrom multihead.models.gpt import GPT, GPTConfig\nfrom multihead.tools import capture, head_view",
    "torch.manual_seed(0)\n"
    "model = GPT(GPTConfig(vocab_size=30, context_length=16, embed_dim=16, num_layers=2, num_heads=2)).eval()\n"
    "tokens = ['a', 'small', 'notebook', 'view']\n"
    "with capture(model) as record, torch.no_grad():\n"
    "    model(torch.tensor([[3, 7, 11, 5]]))\n"
    "attentions = tuple(entry.weights for entry in record.layers)   # as output_attentions: L x [B, H, T, T]",
    "head_view(attentions, tokens, heads='all')",
]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("notebook")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(notebook, folder / "views.ipynb")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", "--execute",
         "--ExecutePreprocessor.timeout=120", "--ExecutePreprocessor.kernel_name=python3", str(folder / "views.ipynb")],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    return folder / "views.html"


def test_the_executed_notebook_shows_the_view_and_no_error(rendered):
    page = rendered.read_text(encoding="utf-8")
    frames = re.findall(r'<iframe class="multihead-view"[^>]*srcdoc="([^"]*)"', page)
    assert len(frames) == 1
    inner = html.unescape(frames[0])
    assert 'id="hv-lines"' in inner and '"query_tokens":["a","small","notebook","view"]' in inner
    assert '"view":"head"' in inner and '"start":{"row":0,"heads":[0,1]}' in inner
    # one output, the view's HTML: no stderr stream, no error (nbconvert renders both as stderr text)
    assert re.findall(r'data-mime-type="([^"]*)"', page) == ["text/html"] and "Traceback" not in page


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium: apt-get install -y chromium")
def test_the_rendered_notebooks_frame_draws(rendered):
    pytest.importorskip("playwright")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.route(re.compile(r"^https?://"), lambda route: route.abort())  # offline, as the view must work
            page.goto(rendered.as_uri(), wait_until="domcontentloaded")
            frame = page.frame_locator("iframe.multihead-view")
            frame.locator("body[data-ready='true']").wait_for(timeout=10000)
            assert frame.locator("#hv-queries .hv-token").all_inner_texts() == ["a", "small", "notebook", "view"]
            assert int(frame.locator("#hv-lines").get_attribute("data-lines")) > 0
        finally:
            browser.close()
