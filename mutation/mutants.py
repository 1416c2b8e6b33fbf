"""Mutants of one Python source file: each is the file with one small, realistic bug.

A mutant changes one operator or constant in an expression and leaves the rest
of the file byte for byte as it was (the mutated expression is re-written with
``ast.unparse`` inside parentheses, so precedence cannot change):

    comparisons   < <->  <=,  > <-> >=,  == <-> !=,  is <-> is not,  in <-> not in
    arithmetic    + <-> -,  * -> /,  / -> *,  // -> /,  ** -> *
    logic         and <-> or,  not x -> x,  -x -> x
    constants     True <-> False,  int n -> n + 1,  float f -> 2 f (0.0 -> 1.0)

Strings, f-strings (messages), annotations and ``__all__`` are left alone.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

_COMPARE = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}  # fmt: skip
_BINARY = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div, ast.Pow: ast.Mult}
_SYMBOL = {
    ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.Is: "is",
    ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in", ast.Add: "+", ast.Sub: "-", ast.Mult: "*",
    ast.Div: "/", ast.FloorDiv: "//", ast.Pow: "**", ast.And: "and", ast.Or: "or",
}  # fmt: skip


@dataclass(frozen=True)
class Mutant:
    """One bug: ``path`` (as given), the line it is on, what it changes, and the mutated file."""

    path: str
    line: int
    description: str
    source: str


def _skipped(tree: ast.AST) -> set[int]:
    """ids of the nodes no mutant touches: inside f-strings, annotations and ``__all__``."""
    skip: set[int] = set()

    def mark(node: ast.AST | None) -> None:
        if node is not None:
            skip.update(id(n) for n in ast.walk(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            mark(node)
        elif isinstance(node, (ast.arg, ast.AnnAssign)):
            mark(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(node.returns)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            mark(node)
    return skip


def _changes(node: ast.AST) -> list[tuple[ast.AST, str]]:
    """(mutated copy of ``node``, description) for every mutation of ``node`` itself."""
    out = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in _COMPARE:
                new = copy.deepcopy(node)
                new.ops[i] = _COMPARE[type(op)]()
                out.append((new, f"{_SYMBOL[type(op)]} -> {_SYMBOL[_COMPARE[type(op)]]}"))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        new = copy.deepcopy(node)
        new.op = _BINARY[type(node.op)]()
        out.append((new, f"{_SYMBOL[type(node.op)]} -> {_SYMBOL[type(new.op)]}"))
    elif isinstance(node, ast.BoolOp):
        new = copy.deepcopy(node)
        new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        out.append((new, f"{_SYMBOL[type(node.op)]} -> {_SYMBOL[type(new.op)]}"))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append((copy.deepcopy(node.operand), "not x -> x" if isinstance(node.op, ast.Not) else "-x -> x"))
    elif isinstance(node, ast.Constant) and isinstance(node.value, bool):
        out.append((ast.Constant(not node.value), f"{node.value} -> {not node.value}"))
    elif isinstance(node, ast.Constant) and isinstance(node.value, int):
        out.append((ast.Constant(node.value + 1), f"{node.value} -> {node.value + 1}"))
    elif isinstance(node, ast.Constant) and isinstance(node.value, float):
        value = 2 * node.value if node.value != 0 else 1.0
        out.append((ast.Constant(value), f"{node.value!r} -> {value!r}"))
    return out


def mutants(path: str, text: str) -> list[Mutant]:
    """Every mutant of ``text`` (the source of ``path``), in source order."""
    data = text.encode("utf-8")
    starts = [0]  # byte offset of each line (ast's col_offset counts UTF-8 bytes)
    for line in data.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    tree = ast.parse(text)
    skip = _skipped(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in skip or not hasattr(node, "end_lineno"):
            continue
        begin = starts[node.lineno - 1] + node.col_offset
        end = starts[node.end_lineno - 1] + node.end_col_offset
        for new, what in _changes(node):
            replaced = data[:begin] + b"(" + ast.unparse(new).encode("utf-8") + b")" + data[end:]
            found.append((begin, Mutant(path, node.lineno, f"line {node.lineno}: {what}", replaced.decode("utf-8"))))
    found.sort(key=lambda item: item[0])
    return [m for _, m in found]
