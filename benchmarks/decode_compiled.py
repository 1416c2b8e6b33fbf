"""Greedy decoding, eager steps against ``generate(compile_steps=True)``.

    python -m benchmarks.decode_compiled --preset gpt2-small --new-tokens 32 --rounds 5

Random weights of the preset, one prompt of 16 tokens per row; each round
runs both modes (taking turns) after one warm-up call of each (the compile),
the tokens checked equal; prints the median tokens per second of each mode
and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from multihead.models.gpt import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset(args.preset)).eval()
    idx = torch.randint(0, model.config.vocab_size, (args.batch, 16))
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.no_grad():
        outputs = {c: model.generate(idx, args.new_tokens, temperature=0, compile_steps=c) for c in (False, True)}
        assert torch.equal(outputs[False], outputs[True]), "compiled steps gave other tokens"
        for _ in range(args.rounds):
            for compiled in (False, True):
                start = time.perf_counter()
                model.generate(idx, args.new_tokens, temperature=0, compile_steps=compiled)
                times[compiled].append(time.perf_counter() - start)
    rate = {c: args.batch * args.new_tokens / statistics.median(t) for c, t in times.items()}
    print(f"| {args.preset}, batch {args.batch}, {args.new_tokens} new tokens | tokens/s (median of {args.rounds}) |")
    print("|---|---|")
    print(f"| eager steps | {rate[False]:.1f} |")
    print(f"| compiled steps | {rate[True]:.1f} ({rate[True] / rate[False]:.2f}x) |")


if __name__ == "__main__":
    main()
