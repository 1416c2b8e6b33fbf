"""The mutation tool (``make mutate``): its mutants are single, valid, realistic bugs."""

from __future__ import annotations

import ast
from pathlib import Path

from mutation.mutants import mutants
from mutation.plan import PLAN
from mutation.run import sample

SOURCE = '''"""doc"""
__all__ = ["f"]


def f(x: int = 1) -> int:
    if x < 2 and not x == 3:
        return -x * 2.5 + 0.0
    raise ValueError(f"x={x + 1}")
'''


def test_each_mutant_changes_one_thing_and_leaves_the_rest_of_the_file():
    found = mutants("m.py", SOURCE)
    got = sorted(m.description for m in found)
    want = sorted([
        "line 5: 1 -> 2",  # the default
        "line 6: and -> or", "line 6: < -> <=", "line 6: 2 -> 3", "line 6: not x -> x", "line 6: == -> !=",
        "line 6: 3 -> 4",
        "line 7: + -> -", "line 7: * -> /", "line 7: -x -> x", "line 7: 2.5 -> 5.0", "line 7: 0.0 -> 1.0",
    ])  # fmt: skip
    assert got == want  # nothing in the docstring, __all__, annotations or the f-string message
    for m in found:
        ast.parse(m.source)
        changed = [i for i, (a, b) in enumerate(zip(SOURCE.splitlines(), m.source.splitlines())) if a != b]
        assert changed == [m.line - 1], m.description
        assert len(m.source.splitlines()) == len(SOURCE.splitlines())


def test_a_mutant_behaves_differently():
    namespace: dict = {}
    exec(next(m.source for m in mutants("m.py", SOURCE) if m.description == "line 6: < -> <="), namespace)
    assert namespace["f"](2) == -5.0  # the original raises for x = 2
    exec(SOURCE, original := {})
    try:
        original["f"](2)
        raise AssertionError("the original should raise for x = 2")
    except ValueError:
        pass


def test_sample_spreads_over_the_file_and_the_plan_names_real_files():
    found = mutants("m.py", SOURCE)
    assert sample(found, 100) == found
    picked = sample(found, 4)
    assert len(picked) == 4 and picked[0] == found[0] and picked[-1] != found[-1]
    assert len({m.line for m in picked}) >= 2
    root = Path(__file__).resolve().parent.parent
    for path, tests in PLAN.items():
        assert (root / path).is_file(), path
        assert tests and all((root / t).is_file() for t in tests), path
