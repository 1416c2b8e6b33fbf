"""A decode step of a Gemma-style GPT (5 local layers : 1 global) over window caches
against the same step over full-length caches in every block.

    python -m benchmarks.local_caches --preset gpt2-small --context 1000 --batch 4 --threads 1

Random weights, rope positions, local layers of ``--window``. Both cache sets
are filled by the same prefill of ``--context`` tokens; then each round times
one decode step over each (taking turns, ``benchmarks.timing``), every cache
put back to its state after the prefill before the step (``save_state`` /
``restore_state``), so every round times the same step. The two steps' logits
are checked to agree. Prints the bytes every cache tensor holds after the
step, the median step time of each and their ratio, with the load average.
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.timing import compare, fmt_ms, summarize, threads, time_alternating
from multihead.models.gpt import GPT, GPTConfig


def _held(caches) -> int:
    """Bytes of the storage every cache tensor keeps."""
    return sum(t.untyped_storage().nbytes() for c in caches for t in (c.k, c.v))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--context", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    options = [{"window": args.window}] * 5 + [{}]
    config = GPTConfig.from_preset(args.preset, positions="rope", layer_attention_options=options)
    torch.manual_seed(0)
    model = GPT(config).eval()
    idx = torch.randint(0, config.vocab_size, (args.batch, args.context + 1))
    S = args.context + 1
    sets = {"window caches": model.make_kv_caches(args.batch, S),
            "full caches": [block.attn.make_kv_cache(args.batch, S) for block in model.blocks]}  # fmt: skip
    with torch.no_grad(), threads(args.threads):
        for caches in sets.values():
            model(idx[:, :-1], kv_caches=caches)
        states = {name: [c.save_state() for c in caches] for name, caches in sets.items()}

        def step(name):
            caches = sets[name]
            for cache, state in zip(caches, states[name]):
                cache.restore_state(state)
            return model(idx[:, -1:], kv_caches=caches)

        torch.testing.assert_close(step("window caches"), step("full caches"))
        held = {name: _held(caches) for name, caches in sets.items()}
        times = time_alternating({name: (lambda n=name: step(n)) for name in sets}, warmup=2, rounds=args.rounds)
    load = os.getloadavg()[0]
    ratio = compare(times["window caches"], times["full caches"])
    print(f"| {args.preset}, 5 local (window {args.window}) : 1 global, batch {args.batch}, context {args.context}, "
          f"threads {torch.get_num_threads() if args.threads is None else args.threads}, load {load:.1f} "
          "| cache MB after the step | decode step ms (median) |")  # fmt: skip
    print("|---|---|---|")
    for name in sets:
        print(f"| {name} | {held[name] / 1e6:.1f} | {fmt_ms(summarize(times[name])['median'])} |")
    print(f"window / full: memory {held['window caches'] / held['full caches']:.3f}, step time "
          f"{ratio['ratio_of_medians']:.2f} (per-round median {ratio['per_round']['median']:.2f})")


if __name__ == "__main__":
    main()
