"""The ``multihead`` command. Each subcommand lists runnable examples in its help."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="multihead",
        description="Multi-head attention: reference, modules, variants and head tools.",
        epilog=(
            "examples:\n"
            '  multihead inspect "The law will never be perfect, but its application should be just."\n'
            "  multihead textbook\n"
            "  multihead generate --preset tiny --max-new-tokens 20 --seed 0"
        ),
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
    tb.add_argument("--tolerance", type=float, default=1e-6, help="largest accepted |difference| (default 1e-6)")
    _add_inspect(sub)
    _add_generate(sub)
    return parser


_INSPECT_EXAMPLES = """examples:
  multihead inspect "The law will never be perfect, but its application should be just."
  multihead inspect "Its application should be just." --layer 2 --out law-heads
  multihead generate --preset tiny --seed 0 --save-init tiny-init
  multihead inspect "To be, or not to be" --checkpoint tiny-init
"""


def _add_inspect(sub) -> None:
    from .commands.inspect import DEFAULT_TEXT, MODELS

    ins = sub.add_parser(
        "inspect",
        help="show what every head of a real model attends to (table, HTML, PNG, JSON)",
        description=(
            "Run TEXT through a pretrained model (all-MiniLM-L6-v2 by default, offline) or a GPT "
            "checkpoint, capture every head's exact attention weights, score each head for documented "
            "roles (previous/next token, self, [CLS], [SEP], punctuation, broad, rare token), print a "
            "table of heads with their roles and strongest token links, and write heads.html (head "
            "view, model view, role table; opens from disk), heads.png and heads.json into --out."
        ),
        epilog=_INSPECT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ins.add_argument("text", nargs="?", default=DEFAULT_TEXT, help=f"the input text (default {DEFAULT_TEXT!r})")
    ins.add_argument("--model", default=MODELS[0], choices=MODELS, help=f"packaged model (default {MODELS[0]})")
    ins.add_argument("--checkpoint", metavar="PATH", help="a GPT checkpoint to inspect instead of --model")
    ins.add_argument("--tokenizer", metavar="FILE", help="tokenizer.json for a checkpoint whose vocabulary is not bytes")
    ins.add_argument("--layer", type=int, metavar="L", help="only this layer")
    ins.add_argument("--out", default="out", metavar="DIR", help="folder for heads.html/png/json (default out)")


_GENERATE_EXAMPLES = """examples:
  multihead generate --preset tiny --max-new-tokens 5 --seed 0
  multihead generate --preset mini --prompt "To be, or not" --temperature 0.8 --top-k 40 --seed 1
  multihead generate --preset tiny --seed 0 --save-init tiny-init
  multihead generate --checkpoint tiny-init --prompt "Hello" --max-new-tokens 20 --top-p 0.9 --seed 0
"""


def _add_generate(sub) -> None:
    from .commands.generate import DEFAULT_PRESET, DEFAULT_PROMPT
    from .models.gpt import GPT_PRESETS

    gen = sub.add_parser(
        "generate",
        help="sample text from a GPT preset (fresh weights) or a saved checkpoint",
        description=(
            "Build a GPT-2 style model from a preset with freshly initialised, seeded weights, or load "
            "a checkpoint (config.json + model.safetensors, e.g. written by --save-init), then sample a "
            "continuation of the prompt and print prompt + continuation. Byte-level models (vocab 256: "
            "the tiny and mini presets) read the prompt as UTF-8 bytes; other vocabularies need "
            "--tokenizer tokenizer.json. Untrained weights produce noise: this shows the decoding "
            "machinery (KV cache, temperature, top-k, top-p), not a language model."
        ),
        epilog=_GENERATE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument(
        "--preset",
        help=f"model preset: {', '.join(GPT_PRESETS)} (default {DEFAULT_PRESET} unless --checkpoint is given)",
    )
    gen.add_argument("--checkpoint", metavar="PATH", help="checkpoint directory or .safetensors file to load")
    gen.add_argument("--prompt", default=DEFAULT_PROMPT, help=f"text to continue (default {DEFAULT_PROMPT!r})")
    gen.add_argument("--max-new-tokens", type=int, default=50, metavar="N", help="tokens to add (default 50)")
    gen.add_argument(
        "--temperature", type=float, default=1.0, metavar="T", help="0 = greedy; higher = more random (default 1.0)"
    )
    gen.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    gen.add_argument(
        "--top-p", type=float, default=None, metavar="P", help="sample among the smallest set with mass >= P"
    )
    gen.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of the weights and the sampling (default 0)"
    )
    gen.add_argument(
        "--tokenizer", metavar="FILE", help="Hugging Face tokenizer.json (required when vocab_size is not 256)"
    )
    gen.add_argument("--save-init", metavar="PATH", help="save the freshly initialised preset model to PATH and exit")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "textbook":
        from .commands.textbook import run

        return run(tolerance=args.tolerance)
    if args.command == "inspect":
        from .commands.inspect import run as inspect

        try:
            inspect(
                args.text,
                model=args.model,
                checkpoint=args.checkpoint,
                tokenizer=args.tokenizer,
                layer=args.layer,
                out=args.out,
            )
        except (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError) as e:
            print(f"multihead inspect: error: {e}", file=sys.stderr)
            return 2
        return 0
    if args.command == "generate":
        from .commands.generate import run as generate

        try:
            return generate(
                preset=args.preset,
                checkpoint=args.checkpoint,
                prompt=args.prompt,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
                tokenizer=args.tokenizer,
                save_init=args.save_init,
            )
        except (ValueError, TypeError, FileNotFoundError) as e:
            print(f"multihead generate: error: {e}", file=sys.stderr)
            return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
