"""``multihead compare``: train one GPT per attention kind and tabulate them.

    multihead compare --attention mha,gqa,mqa --seeds 0,1 --budget-minutes 18 --out runs/compare
        -> runs/compare/{compare.md, compare.json, compare.png, <kind>-seed<s>/ ...}

The training flags of ``multihead train`` that describe the shared setting
(``--preset``, ``--data``, ``--batch-size``, ``--lr``, ...) apply to every
run; ``--attention`` (a comma-separated list), ``--seeds`` and the budget
(``--max-steps`` or ``--budget-minutes``) are this command's own. ``--quick``
is a smoke run (preset "tiny", context 32, batch 8, 4 steps, one seed),
for tests; flags given beside it win. ``--import MODULE`` is imported here
and by each run's process (``CompareConfig.imports``), so kinds of the
user's own package can be compared.

Before any run starts, the kinds, the seeds, ``--out`` and the model every
kind builds in the shared setting (``plan_comparison``) are checked.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable
from typing import Any

from ..train.compare import CompareConfig, compare, plan_comparison
from ..train.compare_plan import default_kinds, parse_kinds
from .checking import checking
from .imports import add_import_argument, import_modules
from .paths import output_folder
from .train import FLAGS

__all__ = ["SHARED_FLAGS", "QUICK", "add_arguments", "run", "compare_config"]

DESCRIPTION = (
    "Train the same GPT once per attention kind and seed (same preset, data, tokenizer, batches "
    "and steps; kinds that change the parameter count get an MLP width that restores the MHA "
    "model's count), each in its own process, then write compare.md, compare.json and "
    "compare.png: final validation loss (spread over seeds), parameters, training tokens/s, "
    "attention FLOPs per token (prefill and decode) and KV-cache bytes per token from each "
    "layer's cost(), and peak memory. --budget-minutes turns a wall-clock budget into steps "
    "by timing each kind first. The training flags of 'multihead train' set the shared "
    "setting; --import MODULE brings kinds of your own package (each run imports it too). "
    "See docs/compare.md."
)

# Flags of ``multihead train`` that every run of a comparison shares.
SHARED_FLAGS = tuple(
    f for f in FLAGS if f.field not in {"attention", "max_steps", "seed", "out", "checkpoint_every", "device"}
)
QUICK: dict[str, Any] = {
    "preset": "tiny", "context_length": 32, "batch_size": 8, "eval_every": 4, "eval_batches": 2,
    "log_every": 1, "warmup": 1,
}  # fmt: skip
QUICK_STEPS, QUICK_SEEDS = 4, (0,)


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers >= 0, got {text!r}") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must be distinct integers >= 0, got {text!r}")
    return seeds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The description and flags of ``multihead compare``."""
    parser.description = DESCRIPTION
    parser.add_argument("--attention", default=None, metavar="KINDS",
                        help="comma-separated attention kinds (default: every registered kind, those of --import "
                             f"modules included; now {','.join(default_kinds())})")  # fmt: skip
    parser.add_argument("--seeds", default=None, metavar="S,S",
                        help="one run per kind and seed (default " + ",".join(map(str, CompareConfig.seeds)) + ")")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--budget-minutes", type=float, metavar="M",
                        help=f"wall-clock budget of the whole comparison (default {CompareConfig.budget_minutes})")
    budget.add_argument("--max-steps", type=int, metavar="N", help="training steps of every run")
    parser.add_argument("--out", default=CompareConfig.out, metavar="DIR", help=f"default {CompareConfig.out}")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny preset, 4 steps, one seed")
    for flag in SHARED_FLAGS:
        parser.add_argument(flag.name, dest=flag.field, type=flag.type, metavar=flag.metavar,
                            help=f"{flag.help} (as in multihead train)")  # fmt: skip
    add_import_argument(parser)


def compare_config(args: argparse.Namespace) -> CompareConfig:
    """The ``CompareConfig`` the command line describes (``--import`` modules already imported).

    Raises:
        ValueError: malformed --seeds, --max-steps < 1, an unknown kind.
    """
    train = {f.field: getattr(args, f.field) for f in SHARED_FLAGS if getattr(args, f.field, None) is not None}
    steps, seeds = args.max_steps, None if args.seeds is None else _seeds(args.seeds)
    if args.quick:
        train = {**QUICK, **train}
        steps = QUICK_STEPS if steps is None and args.budget_minutes is None else steps
        seeds = seeds or QUICK_SEEDS
    if steps is not None and steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {steps}")
    return CompareConfig(
        kinds=default_kinds() if args.attention is None else parse_kinds(args.attention),
        seeds=seeds or CompareConfig.seeds,
        max_steps=steps,
        budget_minutes=args.budget_minutes or CompareConfig.budget_minutes,
        out=args.out,
        train=train,
        imports=tuple(args.imports),
    )


def run(args: argparse.Namespace, *, echo: Callable[[str], None] = print) -> int:
    """``multihead compare``: check the kinds, the setting and --out, run the comparison,
    print where the reports are."""
    with checking():
        import_modules(args.imports)
        config = compare_config(args)
        output_folder("--out", args.out)
        plan_comparison(config)  # every kind's model in the shared setting, before any run starts
    argv = getattr(args, "argv", sys.argv[1:])
    paths = compare(config, command=" ".join(["multihead", *map(shlex.quote, argv)]), echo=echo)
    for name in ("md", "json", "png"):
        echo(f"wrote {name:4s} {paths[name]}")
    return 0
