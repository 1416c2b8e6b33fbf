"""``multihead textbook``: rebuild the book's classes and compare with its numbers.

Each class of Raschka's chapter 3 is constructed right after
``torch.manual_seed`` with the book's seed and run on the book's input batch;
its output is printed beside the published tensor with the largest absolute
difference. A parity table (``commands.parity``) follows.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch

from .. import textbook
from ..data import load_textbook_oracle
from .checking import checking
from .parity import parity_table

__all__ = ["textbook_cases", "add_arguments", "run", "check_tolerance", "report"]

DESCRIPTION = (
    "Rebuild Raschka's chapter-3 attention classes with the book's seeds, print their "
    "tensors beside the published values with the max difference, then a parity table "
    "of multihead vs torch.nn.MultiheadAttention vs F.scaled_dot_product_attention."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead textbook``."""
    parser.description = DESCRIPTION
    parser.add_argument(
        "--tolerance", type=float, default=1e-6, help="largest accepted |difference|, a number >= 0 (default 1e-6)"
    )


def run(args: argparse.Namespace) -> int:
    """``multihead textbook``: 0 when every case matches, 1 otherwise."""
    with checking():
        tolerance = check_tolerance(args.tolerance)
    return report(tolerance)


def _case_class(name: str) -> type[torch.nn.Module]:
    """'MultiHeadAttentionWrapper_d_out2_seed123' -> textbook.MultiHeadAttentionWrapper."""
    for cls_name in sorted(textbook.__all__, key=len, reverse=True):
        if name.startswith(cls_name + "_"):
            return getattr(textbook, cls_name)
    raise ValueError(f"no textbook class for oracle case {name!r}")


def textbook_cases() -> list[dict]:
    """Run every oracle case; return name, seed, args, ours, published, max_diff."""
    oracle = load_textbook_oracle()
    inputs = torch.tensor(oracle["inputs"])  # (6, 3)
    batch = torch.stack((inputs, inputs), dim=0)  # (2, 6, 3), as in the book
    results = []
    for name, case in oracle["cases"].items():
        cls = _case_class(name)
        torch.manual_seed(case["seed"])
        module = cls(**case["args"]).eval()
        published = torch.tensor(case["output"])
        x = inputs if published.dim() == 2 else batch
        with torch.no_grad():
            ours = module(x)
        results.append(
            {
                "name": name,
                "class": cls.__name__,
                "seed": case["seed"],
                "args": case["args"],
                "ours": ours,
                "published": published,
                "max_diff": float((ours - published).abs().max()),
            }
        )
    count = oracle["gpt2_small_attention_parameter_count"]
    module = textbook.MultiHeadAttention(**count["args"])
    results.append(
        {
            "name": "gpt2_small_parameter_count",
            "class": "MultiHeadAttention",
            "args": count["args"],
            "ours": sum(p.numel() for p in module.parameters()),
            "published": count["parameters"],
        }
    )
    return results


def _rows(t: torch.Tensor) -> list[str]:
    return ["[" + ", ".join(f"{v:8.4f}" for v in row) + "]" for row in t.tolist()]


def _print_case(r: dict, echo: Callable[[str], None]) -> None:
    args = ", ".join(f"{k}={v}" for k, v in r["args"].items())
    if r["name"] == "gpt2_small_parameter_count":
        ok = "match" if r["ours"] == r["published"] else "MISMATCH"
        echo(f"\n{r['class']}({args}) parameters: {r['ours']:,} (published {r['published']:,}) {ok}")
        return
    echo(f"\n{r['class']}({args})  seed {r['seed']}")
    ours, pub = r["ours"], r["published"]
    if ours.dim() == 3:
        echo("  batch item 0 shown; the book's batch repeats the same input twice")
        ours, pub = ours[0], pub[0]
    width = len(_rows(ours)[0])
    echo(f"  {'multihead':<{width}}   {'published':<{width}}")
    for a, b in zip(_rows(ours), _rows(pub)):
        echo(f"  {a}   {b}")
    echo(f"  max |difference| = {r['max_diff']:.2e}")


def check_tolerance(tolerance: object) -> float:
    """``--tolerance``: a finite number >= 0.

    Raises:
        TypeError: not a number.
        ValueError: negative, NaN or infinite.
    """
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(f"--tolerance must be a number, got {tolerance!r}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"--tolerance {tolerance}: must be a finite number >= 0 (the largest accepted |difference|)")
    return tolerance


def report(tolerance: float = 1e-6, echo: Callable[[str], None] = print) -> int:
    """Print every case and the parity table; return 0 when all cases match within ``tolerance``, else 1."""
    echo("Textbook attention classes (Raschka, Build a Large Language Model from Scratch, ch. 3)")
    echo("rebuilt with the book's seeds, beside the published tensors")
    results = textbook_cases()
    failures = 0
    for r in results:
        _print_case(r, echo)
        if r["name"] == "gpt2_small_parameter_count":
            failures += r["ours"] != r["published"]
        else:
            failures += r["max_diff"] > tolerance
    echo("")
    for line in parity_table():
        echo(line)
    verdict = "all match" if not failures else f"{failures} case(s) differ by more than {tolerance:g}"
    echo(f"\ntextbook cases: {verdict}")
    return 1 if failures else 0
