"""What starting multihead imports: ``multihead --help`` and ``--version`` answer without
torch, and ``import multihead`` (and its main subpackages) leave the heavy optional
libraries to the code that uses them. Each case runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

HEAVY = ("transformers", "matplotlib", "tokenizers", "playwright")


def _modules_after(code: str) -> tuple[set[str], str]:
    """The top-level module names loaded after ``code`` ran in a fresh interpreter, and its stdout."""
    probe = textwrap.dedent(code) + "\nimport sys\nprint('MODULES', ' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    head, _, modules = done.stdout.rpartition("MODULES ")
    return set(modules.split()), head


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_python_dash_m_multihead_help_and_version_import_no_torch(flag):
    loaded, out = _modules_after(f"""
        import runpy, sys
        sys.argv = ["multihead", "{flag}"]
        try:
            runpy.run_module("multihead", run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            assert exc.code == 0, exc.code
    """)
    assert ("usage: multihead" in out) if flag == "--help" else out.startswith("multihead ")
    assert "torch" not in loaded and "numpy" not in loaded


def test_import_multihead_imports_no_heavy_library():
    loaded, _ = _modules_after("import multihead")
    assert not loaded & {"torch", *HEAVY}, sorted(loaded & {"torch", *HEAVY})


@pytest.mark.parametrize(
    "code",
    [
        "from multihead import MultiHeadAttention, build_attention; build_attention('gqa', embed_dim=8, num_heads=2, num_kv_heads=1)",
        "import multihead.models, multihead.tools, multihead.train",
    ],
)
def test_the_library_imports_heavy_libraries_only_where_used(code):
    loaded, _ = _modules_after(code)
    assert "torch" in loaded  # the code ran
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))


def test_public_names_resolve_on_first_use():
    _, out = _modules_after("""
        import multihead
        names = [n for n in multihead.__all__ if getattr(multihead, n, None) is None]
        print(names, multihead.KVCache.__module__, multihead.UsageError.__name__, "attention" in dir(multihead))
    """)
    assert out.split() == ["[]", "multihead.modules.kv_cache", "UsageError", "True"]
