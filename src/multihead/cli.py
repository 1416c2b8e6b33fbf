"""The ``multihead`` command. Each subcommand lists runnable examples in its help.

A mistake on the command line ends the command with exit status 2 and one
line on stderr, ``multihead <command>: error: ...``, naming the value; nothing
is written. Mistakes argparse finds itself (an unknown flag, a value of the
wrong type) also print the usage of the subcommand above that line.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]

_USER_ERRORS = (ValueError, TypeError, OSError, ImportError)


def build_parser() -> argparse.ArgumentParser:
    """The ``multihead`` parser with its subcommands."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="multihead",
        description="Multi-head attention: reference, modules, variants and head tools.",
        epilog=(
            "examples:\n"
            '  multihead inspect "The law will never be perfect, but its application should be just."\n'
            "  multihead textbook\n"
            "  multihead generate --preset tiny --max-new-tokens 20 --seed 0\n"
            "  multihead train --preset tiny --max-steps 200 --warmup 20 --out runs/tiny\n"
            "  multihead compare --attention mha,gqa,mqa --max-steps 300 --out runs/compare\n"
            "  multihead convert --to gqa --num-kv-heads 2 --checkpoint runs/tiny --out runs/tiny-gqa\n"
            "  multihead prune --model minilm-l6 --method ablation --keep 0.5 --out minilm-half"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subs = {
        "textbook": _add_textbook(sub),
        "inspect": _add_inspect(sub),
        "generate": _add_generate(sub),
        "train": _add_train(sub),
        "compare": _add_compare(sub),
        "convert": _add_convert(sub),
        "prune": _add_prune(sub),
    }
    return parser, subs


def _add_textbook(sub) -> argparse.ArgumentParser:
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
        "--tolerance", type=float, default=1e-6, help="largest accepted |difference|, a number >= 0 (default 1e-6)"
    )
    return tb


_INSPECT_EXAMPLES = """examples:
  multihead inspect "The law will never be perfect, but its application should be just."
  multihead inspect "Its application should be just." --layer 2 --out law-heads
  multihead generate --preset tiny --seed 0 --save-init tiny-init
  multihead inspect "To be, or not to be" --checkpoint tiny-init
  multihead inspect "To be, or not to be" --checkpoint tiny-init --importance
  multihead inspect "The cat sat on the mat." --hf path/to/hf-model-folder --importance
"""


def _add_inspect(sub) -> argparse.ArgumentParser:
    from .commands.inspect import DEFAULT_TEXT, MODELS

    ins = sub.add_parser(
        "inspect",
        help="show what every head of a real model attends to (table, HTML, PNG, JSON)",
        description=(
            "Run TEXT through a pretrained model (all-MiniLM-L6-v2 by default, offline) or a GPT "
            "checkpoint, capture every head's exact attention weights, score each head for documented "
            "roles (previous/next token, self, [CLS], [SEP], punctuation, broad, rare token), print a "
            "table of heads with their roles, a legend of the scores and the strongest token links, and "
            "write heads.html (head view, model view, role table; opens from disk), heads.png and "
            "heads.json into --out. --hf DIR does the same for any local Hugging Face model folder "
            "(config.json, safetensors weights, tokenizer.json), run on multihead attention. --importance "
            "adds each head's ablation score: the loss increase when that head alone is masked (a GPT's LM "
            "loss on the text; for an encoder 1 - cosine between the masked and the whole text's mean-pooled "
            "embedding). A text longer than the model's maximum (256 tokens for MiniLM) is "
            "refused unless --truncate is given."
        ),
        epilog=_INSPECT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ins.add_argument("text", nargs="?", default=DEFAULT_TEXT, help=f"the input text (default {DEFAULT_TEXT!r})")
    ins.add_argument("--model", choices=MODELS, help=f"packaged model (default {MODELS[0]} unless --checkpoint)")
    ins.add_argument(
        "--checkpoint", metavar="PATH",
        help="a GPT checkpoint, or the run directory of 'multihead train', to inspect instead of --model",
    )  # fmt: skip
    ins.add_argument(
        "--tokenizer", metavar="FILE", help="tokenizer.json for a --checkpoint whose vocabulary is not bytes"
    )
    ins.add_argument(
        "--hf", metavar="DIR",
        help="a local Hugging Face model folder (config.json, weights, tokenizer.json) instead of --model",
    )  # fmt: skip
    ins.add_argument(
        "--importance", action="store_true",
        help="score each head by ablation (loss increase when it alone is masked; one pass per head)",
    )  # fmt: skip
    ins.add_argument("--layer", type=int, metavar="L", help="only this layer")
    ins.add_argument(
        "--truncate",
        action="store_true",
        help="analyse the first tokens of a text longer than the model's maximum (with a notice) instead of refusing it",
    )
    ins.add_argument("--out", default="out", metavar="DIR", help="folder for heads.html/png/json (default out)")
    return ins


_GENERATE_EXAMPLES = """examples:
  multihead generate --preset tiny --max-new-tokens 5 --seed 0
  multihead generate --preset mini --prompt "To be, or not" --temperature 0.8 --top-k 40 --seed 1
  multihead generate --preset tiny --seed 0 --save-init tiny-init
  multihead generate --checkpoint tiny-init --prompt "Hello" --max-new-tokens 20 --top-p 0.9 --seed 0
  multihead generate --checkpoint tiny-init "To be" --max-new-tokens 20 --temperature 0
"""


def _add_generate(sub) -> argparse.ArgumentParser:
    from .commands.generate import DEFAULT_MAX_NEW_TOKENS, DEFAULT_PRESET, DEFAULT_PROMPT, DEFAULT_TEMPERATURE
    from .models.gpt import GPT_PRESETS

    gen = sub.add_parser(
        "generate",
        help="sample text from a GPT preset (fresh weights) or a saved checkpoint",
        description=(
            "Build a GPT-2 style model from a preset with freshly initialised, seeded weights, or load "
            "a checkpoint (config.json + model.safetensors, e.g. written by --save-init, or the run "
            "directory of 'multihead train': its latest checkpoint and its own tokenizer), then sample a "
            "continuation of the prompt and print prompt + continuation. Byte-level models (vocab 256: "
            "the tiny and mini presets) read the prompt as UTF-8 bytes; other vocabularies need "
            "--tokenizer tokenizer.json (a run directory brings its tokenizer). A preset's untrained "
            "weights produce noise: they show the decoding machinery (KV cache, temperature, top-k, "
            "top-p), not a language model. --save-init only "
            "saves the model, so the sampling options cannot go with it."
        ),
        epilog=_GENERATE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument(
        "--preset",
        help=f"model preset: {', '.join(GPT_PRESETS)} (default {DEFAULT_PRESET} unless --checkpoint is given)",
    )
    gen.add_argument(
        "--checkpoint",
        metavar="PATH",
        help="checkpoint directory, .safetensors file, or run directory of 'multihead train' to load",
    )
    gen.add_argument("text", nargs="?", metavar="PROMPT", help="text to continue (the same as --prompt)")
    gen.add_argument("--prompt", help=f"text to continue (default {DEFAULT_PROMPT!r})")
    gen.add_argument(
        "--max-new-tokens", type=int, metavar="N", help=f"tokens to add (default {DEFAULT_MAX_NEW_TOKENS})"
    )
    gen.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help=f"0 = greedy; higher = more random (default {DEFAULT_TEMPERATURE})",
    )
    gen.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens")
    gen.add_argument("--top-p", type=float, metavar="P", help="sample among the smallest set with mass >= P")
    gen.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of the weights and the sampling (default 0)"
    )
    gen.add_argument(
        "--tokenizer", metavar="FILE", help="Hugging Face tokenizer.json (required when vocab_size is not 256)"
    )
    gen.add_argument("--save-init", metavar="PATH", help="save the freshly initialised preset model to PATH and exit")
    return gen


_TRAIN_EXAMPLES = """examples:
  multihead train
  multihead train --preset tiny --max-steps 200 --warmup 20 --out runs/tiny
  multihead generate --checkpoint runs/tiny "To be"
  multihead train --out runs/tiny --max-steps 400 --resume
  multihead train --data notes.txt --tokenizer bpe --vocab-size 512 --preset tiny --out runs/notes
  multihead train --attention gqa --attention-option num_kv_heads=2 --out runs/gqa
  torchrun --nproc-per-node 2 -m multihead train --batch-size 64 --out runs/ddp
  torchrun --nproc-per-node 2 -m multihead train --batch-size 64 --shard --out runs/fsdp
"""


def _add_train(sub) -> argparse.ArgumentParser:
    from .commands.train import add_arguments

    tr = sub.add_parser(
        "train",
        help="train a GPT (any attention kind) on Shakespeare or a text file, with checkpoints and resume",
        description=(
            "Train a GPT preset with the chosen attention kind on Shakespeare's plays (downloaded once) "
            "or a UTF-8 text file, tokenized as bytes or BPE: AdamW, linear warm-up then cosine decay, "
            "validation loss every --eval-every steps. The run directory (--out) gets config.json, the "
            "tokenizer, the token files, metrics.jsonl and crash-safe checkpoints; --resume continues "
            "from the latest one with the same config. Each flag sets the TrainConfig field of the same "
            "name; a flag left out keeps TrainConfig's default. Under torchrun every process runs this "
            "command (data parallel, the same global --batch-size; --shard: FSDP2). See docs/training.md."
        ),
        epilog=_TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(tr)
    return tr


_COMPARE_EXAMPLES = """examples:
  multihead compare                                   # every kind, 2 seeds, about 18 minutes
  multihead compare --attention mha,gqa,mqa --seeds 0 --max-steps 300 --out runs/compare
  multihead compare --quick --attention mha,moh --out /tmp/compare
"""


def _add_compare(sub) -> argparse.ArgumentParser:
    from .commands.compare import add_arguments

    cmp = sub.add_parser(
        "compare",
        help="train one GPT per attention kind on the same data and budget; table, JSON and plot",
        description=(
            "Train the same GPT once per attention kind and seed (same preset, data, tokenizer, batches "
            "and steps; kinds that change the parameter count get an MLP width that restores the MHA "
            "model's count), each in its own process, then write compare.md, compare.json and "
            "compare.png: final validation loss (spread over seeds), parameters, training tokens/s, "
            "attention FLOPs per token (prefill and decode) and KV-cache bytes per token from each "
            "layer's cost(), and peak memory. --budget-minutes turns a wall-clock budget into steps "
            "by timing each kind first. The training flags of 'multihead train' set the shared "
            "setting. See docs/compare.md."
        ),
        epilog=_COMPARE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(cmp)
    return cmp


_CONVERT_EXAMPLES = """examples:
  multihead convert --to gqa --num-kv-heads 2 --checkpoint runs/mini-mha --out runs/mini-gqa2
  multihead convert --to gqa --num-kv-heads 2 --method aligned --checkpoint runs/mini-mha --out runs/mini-gqa2a
  multihead convert --to gqa --num-kv-heads 1 --method aligned --checkpoint tiny-init --calibration-data a.txt --out mqa
  multihead generate --checkpoint runs/mini-gqa2 "To be"
"""


def _add_convert(sub) -> argparse.ArgumentParser:
    from .commands.convert import CALIBRATION_BATCH_SIZE, DEFAULT_CALIBRATION_BATCHES, TARGETS
    from .tools.convert_heads import METHODS

    conv = sub.add_parser(
        "convert",
        help="convert a GPT checkpoint's attention to grouped-query attention (GQA/MQA)",
        description=(
            "Load a GPT checkpoint or the run directory of 'multihead train', give every attention layer "
            "G key/value heads (mean: average each group's key and value projections; aligned: rotate the "
            "heads onto each other first, from calibration data), save the converted checkpoint into --out "
            "and print parameters and KV-cache bytes per token before and after, and for a run directory the "
            "validation loss on the run's own validation batches; report.json holds the same. A BPE run's "
            "tokenizer.json is copied beside the checkpoint. See docs/surgery.md."
        ),
        epilog=_CONVERT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    conv.add_argument("--to", required=True, metavar="KIND", help=f"target attention: {', '.join(TARGETS)}")
    conv.add_argument(
        "--num-kv-heads", type=int, required=True, metavar="G", help="key/value heads per layer, dividing H"
    )
    conv.add_argument("--method", default="mean", metavar="M", help=f"{' or '.join(METHODS)} (default mean)")
    conv.add_argument(
        "--checkpoint", required=True, metavar="PATH",
        help="a GPT checkpoint, or the run directory of 'multihead train'",
    )  # fmt: skip
    conv.add_argument("--out", required=True, metavar="DIR", help="folder for the converted checkpoint and report.json")
    conv.add_argument(
        "--calibration-data", metavar="SOURCE",
        help="aligned or recovery: shakespeare or a UTF-8 text file (default: a run directory's data/train.bin)",
    )  # fmt: skip
    conv.add_argument(
        "--calibration-batches", type=int, metavar="N",
        help=f"aligned or recovery: batches of {CALIBRATION_BATCH_SIZE} windows "
        f"(default {DEFAULT_CALIBRATION_BATCHES})",
    )  # fmt: skip
    _add_recover_steps(conv)
    return conv


_PRUNE_EXAMPLES = """examples:
  multihead prune --model minilm-l6 --method ablation --keep 0.5 --out minilm-half
  multihead prune --model minilm-l6 --method gradient --keep 0.75 --calibration-lines 1024 --out minilm-75
  multihead prune --checkpoint runs/mini-mha --method gradient --keep 0.5 --out runs/mini-pruned
  multihead prune --checkpoint runs/mini-mha --method gates --keep 0.5 --recover-steps 200 --out runs/mini-gates
  multihead prune --hf path/to/hf-bert-or-gpt2 --method gradient --keep 0.5 --out pruned
  multihead generate --checkpoint runs/mini-pruned "To be"
"""


def _add_prune(sub) -> argparse.ArgumentParser:
    from .commands.prune import DEFAULT_CALIBRATION_LINES, HELDOUT_LINES, METHODS, MODELS
    from .commands.prune_scores import GATE_PENALTIES, GATE_STEPS

    prune = sub.add_parser(
        "prune",
        help="remove the least important attention heads of MiniLM, a GPT checkpoint or a HF BERT/GPT-2 for good",
        description=(
            "Score every attention head on calibration data, remove the lowest-scoring ones (one ranking over "
            "all layers, at least one head left per layer), save the pruned model into --out and report the "
            f"heads removed, parameters, fidelity (MiniLM, BERT: {HELDOUT_LINES} held-out Shakespeare lines; a run: "
            "its validation loss; GPT-2: the loss on Shakespeare's validation text) and the measured forward "
            "speed-up. The model is saved in multihead's own format (per-layer head counts), with its "
            "tokenizer.json: read it back with load_sentence_encoder, load_checkpoint or --checkpoint. "
            "See docs/surgery.md."
        ),
        epilog=_PRUNE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    prune.add_argument("--model", metavar="NAME", help=f"a pretrained model: {', '.join(MODELS)}")
    prune.add_argument("--checkpoint", metavar="PATH", help="a GPT checkpoint or a multihead train run directory")
    prune.add_argument(
        "--hf", metavar="DIR",
        help="a local Hugging Face folder (config.json, model.safetensors, tokenizer.json) of model_type bert or gpt2",
    )  # fmt: skip
    prune.add_argument("--method", required=True, metavar="M", help=f"importance scores: {' or '.join(METHODS)}")
    prune.add_argument("--keep", required=True, type=float, metavar="FRACTION", help="share of heads kept, in (0, 1]")
    prune.add_argument("--out", required=True, metavar="DIR", help="folder for the pruned model and report.json")
    prune.add_argument(
        "--calibration-lines", type=int, default=DEFAULT_CALIBRATION_LINES, metavar="N",
        help=f"MiniLM: calibration line pairs; GPT: windows, 16 per batch (default {DEFAULT_CALIBRATION_LINES})",
    )  # fmt: skip
    prune.add_argument(
        "--heldout-lines", type=int, metavar="N",
        help=f"MiniLM, BERT: held-out lines of the fidelity (default {HELDOUT_LINES})",
    )  # fmt: skip
    prune.add_argument(
        "--gate-penalties", type=_floats, metavar="P,P,...",
        help="--method gates: L0 penalties, one gate training each (default: "
        + "; ".join(f"{family} {','.join(map(str, p))}" for family, p in GATE_PENALTIES.items()) + ")",
    )  # fmt: skip
    prune.add_argument(
        "--gate-steps", type=int, metavar="N", help=f"--method gates: Adam steps per penalty (default {GATE_STEPS})"
    )
    _add_recover_steps(prune)
    return prune


def _add_recover_steps(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recover-steps", type=int, default=0, metavar="N",
        help="then distil the result towards the original for N steps on the calibration data (default 0: none)",
    )  # fmt: skip


def _floats(text: str) -> tuple[float, ...]:
    """'0.1,0.3' -> (0.1, 0.3)."""
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"give comma-separated numbers such as 0.1,0.3, got {text!r}") from None


def _textbook(args: argparse.Namespace) -> int:
    from .commands.textbook import run

    return run(tolerance=args.tolerance)


def _inspect(args: argparse.Namespace) -> int:
    from .commands.inspect import run

    run(
        args.text,
        model=args.model,
        checkpoint=args.checkpoint,
        tokenizer=args.tokenizer,
        layer=args.layer,
        out=args.out,
        truncate=args.truncate,
        hf=args.hf,
        importance=args.importance,
    )
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .commands.generate import run

    if args.text is not None and args.prompt is not None:
        raise ValueError(
            f"give the prompt once, as PROMPT or --prompt (got {args.text!r} and --prompt {args.prompt!r})"
        )
    return run(
        preset=args.preset,
        checkpoint=args.checkpoint,
        prompt=args.prompt if args.text is None else args.text,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        tokenizer=args.tokenizer,
        save_init=args.save_init,
    )


def _train(args: argparse.Namespace) -> int:
    from .commands.train import config_values, run

    return run(config_values(args), resume=args.resume)


def _compare(args: argparse.Namespace) -> int:
    import shlex

    from .commands.compare import run

    return run(args, command=" ".join(["multihead", *map(shlex.quote, sys.argv[1:])]))


def _convert(args: argparse.Namespace) -> int:
    from .commands.convert import run

    run(
        to=args.to,
        num_kv_heads=args.num_kv_heads,
        checkpoint=args.checkpoint,
        out=args.out,
        method=args.method,
        calibration_data=args.calibration_data,
        calibration_batches=args.calibration_batches,
        recover_steps=args.recover_steps,
    )
    return 0


def _prune(args: argparse.Namespace) -> int:
    from .commands.prune import run

    run(
        method=args.method,
        keep=args.keep,
        out=args.out,
        model=args.model,
        checkpoint=args.checkpoint,
        hf=args.hf,
        calibration_lines=args.calibration_lines,
        heldout_lines=args.heldout_lines,
        gate_penalties=args.gate_penalties,
        gate_steps=args.gate_steps,
        recover_steps=args.recover_steps,
    )
    return 0


_COMMANDS = {
    "textbook": _textbook, "inspect": _inspect, "generate": _generate, "train": _train, "compare": _compare,
    "convert": _convert, "prune": _prune,
}  # fmt: skip


def _one_line(error: BaseException) -> str:
    """The error's message on one line (an OSError without one names its type)."""
    text = " ".join(str(error).split())
    return text or type(error).__name__


def main(argv: list[str] | None = None) -> int:
    """Run ``multihead`` with ``argv`` (default ``sys.argv[1:]``).

    Returns:
        0 on success, 1 when ``textbook`` finds a difference.

    Raises:
        SystemExit: status 2 for a mistake on the command line (one line
            ``multihead <command>: error: ...`` on stderr), 0 after
            ``--help`` or ``--version``.
    """
    parser, subs = _parsers()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.error(f"choose a command: {', '.join(subs)} ('multihead COMMAND --help' shows its options)")
    sub = subs[args.command]
    if extra:
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return _COMMANDS[args.command](args)
    except _USER_ERRORS as e:
        from .commands.train import is_rank_zero

        # Under torchrun every process meets the same mistake: rank 0 says it once.
        sub.exit(2, f"{sub.prog}: error: {_one_line(e)}\n" if is_rank_zero() else None)


if __name__ == "__main__":
    sys.exit(main())
