"""The ``multihead`` command: a table of subcommands, each a module of ``multihead.commands``
with ``add_arguments(parser)`` and ``run(args) -> int``, imported only when it runs (``--help``
and ``--version`` import no torch). A user mistake is one line on stderr and exit status 2
(``--debug`` adds the traceback); a bug (any other exception, ``commands.checking``) prints its
traceback and a line saying it is a bug in multihead, and exits with status 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import traceback
from dataclasses import dataclass
from types import ModuleType

from . import __version__
from .commands.checking import environment_error, one_line
from .errors import UsageError

__all__ = ["Command", "COMMANDS", "main", "build_parsers"]


@dataclass(frozen=True)
class Command:
    """One subcommand; its ``module``, imported on first use, has ``add_arguments`` and ``run``."""

    name: str
    help: str
    examples: tuple[str, ...]  # the first one also goes on ``multihead --help``

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"{__package__}.commands.{self.name}")


COMMANDS = (
    Command("textbook", "rebuild the textbook classes with the book's seeds and compare with its numbers", (
        "multihead textbook", "multihead textbook --tolerance 1e-7")),
    Command("inspect", "show what every head of a real model attends to (table, HTML, PNG, JSON)", (
        'multihead inspect "The law will never be perfect, but its application should be just."',
        'multihead inspect "Its application should be just." --layer 2 --out law-heads',
        "multihead generate --preset tiny --seed 0 --save-init tiny-init",
        'multihead inspect "To be, or not to be" --checkpoint tiny-init',
        'multihead inspect "The cat sat on the mat." --hf path/to/hf-model-folder --importance',
        'multihead inspect "To be, or not to be" --import mykinds --checkpoint runs/mine')),
    Command("generate", "sample text from a GPT preset (fresh weights) or a saved checkpoint", (
        "multihead generate --preset tiny --max-new-tokens 5 --seed 0",
        'multihead generate --preset mini --prompt "To be, or not" --temperature 0.8 --top-k 40 --seed 1',
        "multihead generate --preset tiny --seed 0 --save-init tiny-init",
        'multihead generate --checkpoint tiny-init --prompt "Hello" --max-new-tokens 20 --top-p 0.9 --seed 0',
        'multihead generate --checkpoint tiny-init "To be" --max-new-tokens 20 --temperature 0 --weights int8',
        'multihead generate --import mykinds --checkpoint tiny-init "To be" --max-new-tokens 5')),
    Command("train", "train a GPT (any attention kind) on Shakespeare or a text file, with checkpoints and resume", (
        "multihead train --preset tiny --max-steps 200 --warmup 20 --out runs/tiny",
        'multihead train', 'multihead generate --checkpoint runs/tiny "To be"',
        "multihead train --out runs/tiny --max-steps 400 --resume", "multihead train --preset tiny --track-heads --out runs/tiny",
        "multihead train --attention gqa --attention-option num_kv_heads=2 --out runs/gqa",
        """multihead train --preset tiny --positions rope --layer-attention-options '[{"window": 32}, {}]' --out runs/rope""",
        "multihead train --import mykinds --attention my_kind --out runs/mine",
        "torchrun --nproc-per-node 2 -m multihead train --batch-size 64 --out runs/ddp",
        "torchrun --nproc-per-node 2 -m multihead train --tensor-parallel 2 --out runs/tp")),
    Command("heads", "plot how the heads of a --track-heads run took their roles (induction, ...)", ("multihead heads runs/tiny", "multihead heads runs/tiny --threshold 0.5 --out induction.png")),
    Command("compare", "train one GPT per attention kind on the same data and budget; table, JSON and plot", (
        "multihead compare                                   # every kind, 2 seeds, about 18 minutes",
        "multihead compare --attention mha,gqa,mqa --seeds 0 --max-steps 300 --out runs/compare",
        "multihead compare --quick --attention mha,moh --out /tmp/compare",
        "multihead compare --import mykinds --attention mha,my_kind --max-steps 300 --out runs/mine")),
    Command("convert", "convert the attention of MiniLM, a GPT checkpoint or a HF BERT/GPT-2 to GQA, MQA or MLA", (
        "multihead convert --to gqa --num-kv-heads 2 --checkpoint runs/mini-mha --out runs/mini-gqa2",
        "multihead convert --to mqa --model minilm-l6 --out minilm-mqa",
        "multihead convert --to mla --kv-rank 128 --model minilm-l6 --out minilm-mla128",
        "multihead convert --to mqa --method aligned --checkpoint tiny-init --calibration-data a.txt --out mqa",
        'multihead generate --checkpoint runs/mini-gqa2 "To be"',
        "multihead convert --import mykinds --to gqa --num-kv-heads 1 --checkpoint runs/mine --out runs/mine-mqa")),
    Command("prune", "remove the least important attention heads of MiniLM, a GPT checkpoint or a HF BERT/GPT-2", (
        "multihead prune --model minilm-l6 --method ablation --keep 0.5 --out minilm-half",
        "multihead prune --checkpoint runs/mini-mha --method gradient --keep 0.5 --out runs/mini-pruned",
        "multihead prune --checkpoint runs/mini-mha --method gates --keep 0.5 --recover-steps 200 --out runs/mini-gates",
        "multihead prune --hf path/to/hf-bert-or-gpt2 --method gradient --keep 0.5 --out pruned",
        'multihead generate --checkpoint runs/mini-pruned "To be"',
        "multihead prune --import mykinds --checkpoint runs/mine --method gradient --keep 0.5 --out runs/mine-pruned")),
    Command("export", "write a GPT or MiniLM as a Hugging Face folder that transformers loads", (
        "multihead export --checkpoint runs/tiny --hf tiny-hf", "multihead export --model minilm-l6 --hf minilm-hf",
        'multihead generate --hf tiny-hf "To be"')),
    Command("roofline", "where a GPT's prefill and decoding sit against this machine's measured limits", (
        "multihead roofline --preset gpt2-small --context 1024",
        "multihead roofline --attention gqa --attention-option num_kv_heads=4 --batch 8 --measure --out roof",
        "multihead roofline --import mykinds --attention my_kind --preset gpt2-small")),
    Command("effects", "which heads carry a GPT's answer: zero, mean-ablate or patch one head at a time; heatmap page", (
        'multihead effects --checkpoint runs/tiny --clean "To be, or not" --corrupted "To go, or not" --answer " " --wrong "t"',
        'multihead effects --hf gpt2-folder --clean "When Mary and John went out, John gave it to" '
        '--corrupted "When Mary and John went out, Mary gave it to" --answer " Mary" --wrong " John"',
        'multihead effects --import mykinds --checkpoint runs/mine --method zero --clean "To be" --answer "," --wrong "."')),
)  # fmt: skip

_BUG = ("multihead: this is a bug in multihead {0} (torch {1}, Python {2}), not a mistake of yours: please report "
        "it to the multihead maintainers with the command line and the traceback above")
_RAW = argparse.RawDescriptionHelpFormatter


def _epilog(examples) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in examples)


class _Parser(argparse.ArgumentParser):
    """argparse's own mistakes as one line that says where to look (no usage above it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help'\n")


def build_parsers(load=None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The ``multihead`` parser and each subcommand's, by name (with flags: those in ``load``, None: all)."""
    parser = _Parser(prog="multihead", epilog=_epilog(c.examples[0] for c in COMMANDS), formatter_class=_RAW,
                     description="Multi-head attention: reference, modules, variants and head tools.")  # fmt: skip
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a mistake too")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subs = {c.name: sub.add_parser(c.name, help=c.help, epilog=_epilog(c.examples), formatter_class=_RAW) for c in COMMANDS}
    for command in COMMANDS:
        if load is None or command.name in load:
            command.module.add_arguments(subs[command.name])
    return parser, subs


def main(argv: list[str] | None = None) -> int:
    """Run ``multihead`` with ``argv`` (default ``sys.argv[1:]``); return the exit status (0, or 1 when
    ``textbook`` finds a difference or after a bug). Raises SystemExit: 2 after a user mistake, 0 after --help."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, subs = build_parsers(load=[next((a for a in argv if not a.startswith("-")), "")])
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.error(f"unrecognized arguments: {' '.join(extra)}" if extra else f"choose a command: {', '.join(subs)}")
    sub = subs[args.command]
    if extra:
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = argv  # the command line, for the reports that record it
    try:
        return next(c.module for c in COMMANDS if c.name == args.command).run(args)
    except BrokenPipeError:  # the reader stopped early (`multihead inspect ... | head`): nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 141  # 128 + SIGPIPE, as a shell reports a writer the pipe stopped
    except Exception as e:
        if not (isinstance(e, UsageError) or environment_error(e)):
            traceback.print_exc()
            torch = getattr(sys.modules.get("torch"), "__version__", "not imported")
            print(_BUG.format(__version__, torch, platform.python_version()), file=sys.stderr)
            return 1
        if args.debug:
            traceback.print_exc()
        # Under torchrun every process meets the same mistake: rank 0 says it once.
        rank_zero = importlib.import_module(f"{__package__}.commands.train").is_rank_zero()
        sub.exit(2, f"{sub.prog}: error: {one_line(e)}\n" if rank_zero else None)

