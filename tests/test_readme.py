"""The README's library example runs as written."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def test_readme_has_a_short_library_example():
    blocks = _python_blocks()
    assert blocks, "README has no python example"
    assert len(blocks[0].strip().splitlines()) <= 12


def test_readme_example_runs(tmp_path, capsys):
    script = tmp_path / "example.py"
    script.write_text(_python_blocks()[0], encoding="utf-8")
    runpy.run_path(str(script), run_name="__main__")
    assert "torch.Size([2, 10, 64]) torch.Size([2, 8, 10, 10]) torch.Size([2, 2, 16, 8])" in capsys.readouterr().out


def test_model_examples_are_five_lines_and_run(tmp_path, capsys):
    blocks = _python_blocks()[1:]
    assert len(blocks) == 5
    for i, block in enumerate(blocks):
        code = [line for line in block.strip().splitlines() if line.strip()]
        assert len(code) <= 5, block
        script = tmp_path / f"model_{i}.py"
        script.write_text(block, encoding="utf-8")
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "torch.Size([1, 13])"
    assert out[1].startswith("torch.Size([2, 384]) ")
    assert out[2].endswith(" 2")
    assert out[3].startswith("torch.Size([2, 10, 64]) ")
    assert out[4] == "2 [3, 4]"  # the head surgery example
