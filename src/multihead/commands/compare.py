"""``multihead compare``: train one GPT per attention kind and tabulate them.

    multihead compare --attention mha,gqa,mqa --seeds 0,1 --budget-minutes 18 --out runs/compare
        -> runs/compare/{compare.md, compare.json, compare.png, <kind>-seed<s>/ ...}

The training flags of ``multihead train`` that describe the shared setting
(``--preset``, ``--data``, ``--batch-size``, ``--lr``, ...) apply to every
run, with this command's own defaults (``train.compare.DEFAULT_TRAIN``, shown
by ``--help``); ``--attention`` (a comma-separated list), ``--seeds``, the
budget (``--max-steps`` or ``--budget-minutes``) and ``--attention-option
KIND:K=V`` (options of one kind) are this command's own. ``--quick`` is a
smoke test (preset "tiny", context 32, batch 8, 4 steps, one seed) whose
reports say so and leave out the speed; flags given beside it win.
``--import MODULE`` is imported here and by each run's process
(``CompareConfig.imports``), so kinds of the user's own package can be compared.

Before any run starts, the kinds, the seeds, ``--out`` (a comparison it holds
must be this one, which is then continued) and the model every kind builds in
the shared setting (``plan_comparison``) are checked. SIGINT/SIGTERM stop the
comparison: one line says which runs were kept and the command that
continues, and the exit status is 130/143.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Callable
from typing import Any

from ..paths import output_folder
from ..train.compare import DEFAULT_TRAIN, EVAL_POINTS, CompareConfig, compare, continued_steps, plan_comparison
from ..train.compare_plan import default_kinds, parse_kinds
from ..train.compare_runs import Interrupted
from ..train.config import TrainConfig
from .checking import checking
from .imports import add_import_argument, import_modules
from .train import FLAGS, parse_attention_options

__all__ = ["SHARED_FLAGS", "QUICK", "add_arguments", "run", "compare_config", "parse_kind_options"]

DESCRIPTION = (
    "Train the same GPT once per attention kind and seed (same preset, data, tokenizer, batches "
    "and steps; kinds that change the parameter count get an MLP width that restores the MHA "
    "model's count), each in its own process, then write compare.md, compare.json and "
    "compare.png: final validation loss (spread over seeds), parameters, training tokens/s, "
    "attention FLOPs per token (prefill and decode) and KV-cache bytes per token from each "
    "layer's cost() (with local layers also one sequence's bytes at the context), and peak memory. --budget-minutes turns a wall-clock budget into steps "
    "by timing each kind first. The training flags of 'multihead train' set the shared "
    "setting (with the defaults below); --import MODULE brings kinds of your own package "
    "(each run imports it too). Ctrl-C keeps the finished runs: the same command continues. "
    "See docs/compare.md."
)

# Flags of ``multihead train`` that every run of a comparison shares (the MLP width is the size
# rule's; each run is one process, so --shard has nothing to shard).
SHARED_FLAGS = tuple(
    f for f in FLAGS if f.field not in {"attention", "max_steps", "seed", "out", "checkpoint_every", "device", "mlp_dim", "shard"}
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


def _default(flag) -> str:
    """This command's default of a shared flag, for the help."""
    if flag.field == "warmup":
        return f"default {DEFAULT_TRAIN['warmup']}, at most a tenth of the steps"
    if flag.field == "eval_every":
        return f"default the steps / {EVAL_POINTS}"
    if flag.field in DEFAULT_TRAIN:
        return f"default {DEFAULT_TRAIN[flag.field]}"
    value = next(f.default for f in dataclasses.fields(TrainConfig) if f.name == flag.field)
    return f"default {flag.when_none or 'derived'}" if value is None else f"default {value}"


def parse_kind_options(items: list[str] | None, kinds: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """``["gqa:num_kv_heads=1", "moh:top_k=2"]`` -> ``{"gqa": {"num_kv_heads": 1}, "moh": {"top_k": 2}}``,
    each ``K=V`` read as ``multihead train --attention-option`` reads it.

    Raises:
        ValueError: an item without ``KIND:``, a kind that is not compared, a
            malformed ``K=V`` or an option given twice for one kind.
    """
    texts: dict[str, list[str]] = {}
    for item in items or ():
        kind, sep, option = item.partition(":")
        kind = kind.strip()
        if not sep or not kind or "=" in kind:
            raise ValueError(f"--attention-option {item!r}: expected KIND:K=V (e.g. gqa:num_kv_heads=1)")
        if kind not in kinds:
            raise ValueError(f"--attention-option {item!r}: {kind!r} is not one of the compared kinds {list(kinds)}")
        texts.setdefault(kind, []).append(option)
    return {kind: parse_attention_options(options) for kind, options in texts.items()}


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
    parser.add_argument("--quick", action="store_true",
                        help="a smoke test: tiny preset, 4 steps, one seed; its reports say so and have no speeds")
    parser.add_argument("--attention-option", dest="attention_option", action="append", metavar="KIND:K=V",
                        help="an option of one kind over its comparison default, V read as JSON when it parses "
                             "(gqa:num_kv_heads=1); repeat for more")  # fmt: skip
    for flag in SHARED_FLAGS:
        parser.add_argument(flag.name, dest=flag.field, type=flag.type, metavar=flag.metavar,
                            help=f"{flag.help} ({_default(flag)})")  # fmt: skip
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
    kinds = default_kinds() if args.attention is None else parse_kinds(args.attention)
    return CompareConfig(
        kinds=kinds,
        seeds=seeds or CompareConfig.seeds,
        max_steps=steps,
        budget_minutes=args.budget_minutes or CompareConfig.budget_minutes,
        out=args.out,
        train=train,
        imports=tuple(args.imports),
        attention_options=parse_kind_options(getattr(args, "attention_option", None), kinds),
        smoke_test=args.quick,
    )


def run(args: argparse.Namespace, *, echo: Callable[[str], None] = print) -> int:
    """``multihead compare``: check the kinds, the setting and --out, run the comparison,
    print where the reports are. Returns 0, or 130/143 after SIGINT/SIGTERM (one line on
    stderr says what was kept and how to continue)."""
    with checking():
        import_modules(args.imports)
        config = compare_config(args)
        output_folder("--out", args.out)
        plan_comparison(config)  # every kind's model in the shared setting, before any run starts
        continued_steps(config)  # --out holds nothing, or this very comparison
    command = " ".join(["multihead", *map(shlex.quote, getattr(args, "argv", sys.argv[1:]))])
    try:
        paths = compare(config, command=command, echo=echo)
    except Interrupted as e:
        kept = f"kept the {len(e.kept)} finished run(s) ({', '.join(e.kept)})" if e.kept else "no run had finished"
        print(f"multihead compare: stopped by {e.name}; {kept} in {config.out}; continue with: {command}",
              file=sys.stderr, flush=True)  # fmt: skip
        return e.exit_status
    for name in ("md", "json", "png"):
        echo(f"wrote {name:4s} {paths[name]}")
    return 0
