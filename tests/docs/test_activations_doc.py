"""docs/activations.md: its example runs as written and prints what the page says."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "activations.md"


def test_the_example_runs_and_keeps_what_it_asks_for(tmp_path, capsys):
    block = re.findall(r"```python\n(.*?)```", PAGE.read_text(encoding="utf-8"), flags=re.S)[0]
    script = tmp_path / "example.py"
    script.write_text(block, encoding="utf-8")
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "torch.Size([2, 4, 10, 16]) torch.Size([2, 4, 10, 10])"  # tiny preset: 4 heads of width 16
    assert out[1] == "['layers.0.z', 'layers.0.attn_out'] torch.Size([2, 1, 10, 16])"


def test_the_table_lists_every_name():
    from multihead.tools import ACTIVATION_NAMES

    text = PAGE.read_text(encoding="utf-8")
    assert [n for n in ACTIVATION_NAMES if f"| `{n}` |" not in text] == []
