"""The ``multihead`` command. Each subcommand lists runnable examples in its help."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multihead",
        description="Multi-head attention: reference, modules, variants and head tools.",
        epilog="examples:\n  multihead textbook\n  multihead textbook --tolerance 1e-6",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    tb = sub.add_parser(
        "textbook",
        help="rebuild the textbook classes with the book's seeds and compare with its numbers",
        description=(
            "Rebuild Raschka's chapter-3 attention classes with the book's seeds, print their "
            "tensors beside the published values with the max difference, then a parity table "
            "of multihead vs torch.nn.MultiheadAttention vs F.scaled_dot_product_attention."
        ),
        epilog="examples:\n  multihead textbook\n  multihead textbook --tolerance 1e-7",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tb.add_argument(
        "--tolerance", type=float, default=1e-6, help="largest accepted |difference| (default 1e-6)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "textbook":
        from .commands.textbook import run

        return run(tolerance=args.tolerance)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
