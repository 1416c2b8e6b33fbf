"""``multihead compare``: train one GPT per attention kind and tabulate them.

    multihead compare --attention mha,gqa,mqa --seeds 0,1 --budget-minutes 18 --out runs/compare
        -> runs/compare/{compare.md, compare.json, compare.png, <kind>-seed<s>/ ...}

The training flags of ``multihead train`` that describe the shared setting
(``--preset``, ``--data``, ``--batch-size``, ``--lr``, ...) apply to every
run; ``--attention`` (a comma-separated list), ``--seeds`` and the budget
(``--max-steps`` or ``--budget-minutes``) are this command's own. ``--quick``
is a smoke run (preset "tiny", context 32, batch 8, 4 steps, one seed),
for tests; flags given beside it win.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .train import FLAGS

__all__ = ["SHARED_FLAGS", "QUICK", "add_arguments", "run"]

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


def add_arguments(parser) -> None:
    """Add the ``compare`` flags to ``parser``."""
    from ..train.compare import CompareConfig
    from ..train.compare_plan import default_kinds

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


def run(args, *, command: str = "", echo: Callable[[str], None] = print) -> int:
    """Run the comparison an ``argparse.Namespace`` describes; print where the reports are."""
    from ..train.compare import CompareConfig, compare
    from ..train.compare_plan import default_kinds, parse_kinds
    from .paths import output_folder

    train = {f.field: getattr(args, f.field) for f in SHARED_FLAGS if getattr(args, f.field, None) is not None}
    steps, seeds = args.max_steps, None if args.seeds is None else _seeds(args.seeds)
    if args.quick:
        train = {**QUICK, **train}
        steps = QUICK_STEPS if steps is None and args.budget_minutes is None else steps
        seeds = seeds or QUICK_SEEDS
    if steps is not None and steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {steps}")
    output_folder("--out", args.out)
    config = CompareConfig(
        kinds=default_kinds() if args.attention is None else parse_kinds(args.attention),
        seeds=seeds or CompareConfig.seeds,
        max_steps=steps,
        budget_minutes=args.budget_minutes or CompareConfig.budget_minutes,
        out=args.out,
        train=train,
    )
    paths = compare(config, command=command, echo=echo)
    for name in ("md", "json", "png"):
        echo(f"wrote {name:4s} {paths[name]}")
    return 0
