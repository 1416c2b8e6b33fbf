"""No import circles in src/multihead.

The graph is read from the source with ``ast`` (nothing is imported). Its
nodes are the modules of the package; a package is the node of its
``__init__.py``. Module A has an edge to module B for every import
statement in A, wherever it stands (module level, inside a function or
method, under ``if TYPE_CHECKING:``, in a ``try``):

    import multihead.a.b            -> multihead.a.b
    from P import n                 -> P.n when P.n is a module or package here,
                                       else P (a name defined in P or re-exported by it)
    from .x import y   (in a package's __init__)   -> the module x beside it (or x.y)
    from . import x    /  from .. import pkg       -> the module x / the package pkg

Relative imports resolve against A's package (for an ``__init__.py``, the
package itself). Importing ``P.x`` is not an edge to ``P``, although
Python runs ``P/__init__.py`` first: a package that re-exports its children
would otherwise be in a circle with every child that imports a sibling.
A package's own re-exports are its edges, so ``from multihead import X``
inside the package is an edge to ``multihead/__init__.py`` and through it
to everything that file imports. Imports of other distributions are
ignored, and so are imports by name at run time (``importlib``).

A circle is a strongly connected component of more than one module, or a
module that imports itself; the failure lists each with the import lines
that close it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "multihead"


def module_files(src: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package) for every .py file under ``src/package``."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


def imports_of(name: str, path: Path, is_package: bool, known: set[str]) -> set[tuple[str, int]]:
    """(imported module, line) for every import statement of one module that names a module in ``known``."""
    here = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out.update((a.name, node.lineno) for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                if f"{source}.{a.name}" in known:
                    out.add((f"{source}.{a.name}", node.lineno))
                elif source in known:
                    out.add((source, node.lineno))
    return out


def import_graph(src: Path, package: str) -> dict[str, set[tuple[str, int]]]:
    files = module_files(src, package)
    return {name: imports_of(name, path, is_pkg, set(files)) for name, (path, is_pkg) in files.items()}


def circles(graph: dict[str, set[tuple[str, int]]]) -> list[list[str]]:
    """The strongly connected components with a circle in them (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted({t for t, _ in graph[root]})))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, targets = work[-1]
            w = next(targets, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted({t for t, _ in graph[w]}))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1 or any(t == v for t, _ in graph[v]):
                    found.append(sorted(component))
    return found


def describe(graph: dict[str, set[tuple[str, int]]], component: list[str]) -> str:
    inside = set(component)
    lines = [f"  {a}:{line} imports {b}" for a in component for b, line in sorted(graph[a]) if b in inside]
    return "\n".join(lines)


def test_src_has_no_import_circle():
    graph = import_graph(SRC, PACKAGE)
    assert len(graph) > 50 and any(graph.values())  # the graph was read, not empty
    found = circles(graph)
    report = "\n\n".join(describe(graph, c) for c in found)
    assert not found, f"{len(found)} import circle(s) in src/{PACKAGE}:\n{report}"


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, set[tuple[str, int]]]:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return import_graph(tmp_path, "pkg")


def test_the_rule_sees_circles_of_every_form(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "__init__.py": "from .low import helper\nfrom . import high\n",
            "low/__init__.py": "from .a import a as helper\n",
            "low/a.py": "def a():\n    from ..high import h  # inside a function\n",
            "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
            "low/c.py": "import pkg.low.b\n",
            "high.py": "from pkg.low.a import a\n\ndef h():\n    pass\n",
            "top_name_user.py": "from pkg import high\n",
            "selfish.py": "from . import selfish\n",
            "quiet/__init__.py": "from .child import x\n",
            "quiet/child.py": "from ..quiet import sibling\nx = 1\n",
            "quiet/sibling.py": "import os\nimport numpy\n",
        },
    )
    assert sorted(circles(graph)) == [
        ["pkg.high", "pkg.low.a"],  # a function-level import closes it
        ["pkg.low.b", "pkg.low.c"],  # TYPE_CHECKING counts; `import pkg.low.b` is an edge to b
        ["pkg.selfish"],
    ]
    # importing pkg.low.a or pkg.high is no edge to pkg or pkg.low (whose __init__ files import them),
    # and `from ..quiet import sibling` names a module: no edge to quiet/__init__.py
    assert ("pkg.quiet.sibling", 1) in graph["pkg.quiet.child"]
    assert graph["pkg.quiet.sibling"] == set()
    assert {t for t, _ in graph["pkg"]} == {"pkg.low", "pkg.high"}
    assert {t for t, _ in graph["pkg.top_name_user"]} == {"pkg.high"}


def test_a_package_reexport_closes_a_circle(tmp_path):
    """``from pkg import name`` in a child of pkg is an edge to pkg/__init__.py, which imports the child."""
    graph = _tree(
        tmp_path, {"__init__.py": "from .child import f\nVERSION = 1\n", "child.py": "from pkg import VERSION\n"}
    )
    assert circles(graph) == [["pkg", "pkg.child"]]
    assert "pkg.child:1 imports pkg" in describe(graph, ["pkg", "pkg.child"])


def test_files_over_500_lines_say_why():
    """The house style's file budget: a module of src/ over 500 lines says why in its
    docstring (a sentence naming the 500 lines), or is cut."""
    long = []
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 500:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "500 lines" not in doc:
                long.append(f"{path.relative_to(SRC)} ({text.count(chr(10))} lines)")
    assert not long, f"over 500 lines with no sentence saying why: {long}"
