"""Kinds of installed packages: the entry-point group ``multihead.attention_kinds``.

Each test writes a tiny distribution into tmp_path (a module and a
``*.dist-info`` folder whose entry_points.txt declares it) and imports
multihead in a fresh interpreter with tmp_path on its path, the way an
installed package is found.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

KIND_MODULE = '''
from multihead import MultiHeadAttention, register_attention

@register_attention("entry_point_heads")
class EntryPointHeads(MultiHeadAttention):
    kind = "entry_point_heads"
'''


def _distribution(root: Path, name: str, module: str, source: str) -> None:
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[multihead.attention_kinds]\n{name} = {module}\n")


def _python(root: Path, code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_an_installed_packages_kinds_are_registered_on_import(tmp_path):
    _distribution(tmp_path, "entry-point-heads", "entry_point_heads_kind", KIND_MODULE)
    done = _python(tmp_path, textwrap.dedent('''
        import multihead
        m = multihead.build_attention("entry_point_heads", embed_dim=8, num_heads=2)
        print(type(m).__name__, multihead.attention_class("entry_point_heads").independent_heads)
    '''))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["EntryPointHeads", "True"]


def test_a_broken_entry_point_warns_and_multihead_still_imports(tmp_path):
    _distribution(tmp_path, "broken-heads", "broken_heads_kind", "raise RuntimeError('no such weights')\n")
    done = _python(tmp_path, "import multihead; print(len(multihead.list_attention_kinds()))")
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 9
    assert "the attention-kind entry point 'broken-heads' (broken_heads_kind) failed to import" in done.stderr
    assert "RuntimeError: no such weights" in done.stderr
