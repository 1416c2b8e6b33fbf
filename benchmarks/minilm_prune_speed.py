"""Encode speed of the pretrained all-MiniLM-L6-v2 with heads physically removed.

    .venv/bin/python -m benchmarks.minilm_prune_speed [--rounds 15] [--threads 2 1]

Variants: the unpruned model (12 heads per layer) and copies that keep
``--keep`` heads in every layer (default 10, 8, 6, 4, 2, 1: 17 to 92 %
pruned). Speed depends on how many heads a layer keeps, not on which, so
every layer loses the same number; which ones is a seeded draw
(``random.Random(--seed)``, one draw per layer and variant). Each copy is
pruned with ``tools.prune.prune_heads`` and checked against the unpruned
model under ``tools.heads.mask_heads`` of the same table before timing.

Batch: ``--lines`` distinct lines of Shakespeare's validation works
(``load_corpus("shakespeare").val``) with at least 5 words and at most
``--max-tokens`` tokens ([CLS] and [SEP] included), drawn with
``random.Random(--seed)``, padded together to the longest line (as
``SentenceEncoder.tokenize`` pads). One step: the sentence embeddings of
the batch (eval mode, ``torch.inference_mode``).

Timing (``benchmarks.timing``): all variants in one process, round robin in
each round, ``--warmup`` discarded rounds, ``--number`` calls per
measurement; per variant the median ms per batch and the median of the
per-round ratios to the unpruned model. Also: parameters, attention and MLP
FLOPs of the six layers (``cost()`` and 4·B·T·C·I), and the share of the
unpruned model's time spent inside the attention modules and inside the MLPs
(forward hooks, timed apart from the measured rounds). Prints markdown.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import random
import statistics
import time

import torch

from multihead.models.minilm import SentenceEncoder, Tokenized, load_minilm
from multihead.tools.heads import attention_layers, mask_heads
from multihead.tools.prune import prune_heads
from multihead.train.corpus import load_corpus

from .timing import threads, time_alternating


def batch_lines(model: SentenceEncoder, count: int, max_tokens: int, seed: int) -> list[str]:
    """``count`` distinct validation lines of >= 5 words and <= ``max_tokens`` tokens."""
    stripped = (line.strip() for line in load_corpus("shakespeare").val.split("\n"))
    lines = sorted({s for s in stripped if len(s.split()) >= 5})
    lines = [s for s in lines if len(model.tokenizer.encode(s).ids) <= max_tokens]
    if len(lines) < count:
        raise ValueError(f"asked for {count} lines, the validation works have {len(lines)} that qualify")
    return random.Random(seed).sample(lines, count)


def prune_table(num_layers: int, num_heads: int, keep: int, rng: random.Random) -> dict[int, list[int]]:
    """{layer: sorted heads to remove}, ``num_heads - keep`` of them in every layer."""
    if not 1 <= keep <= num_heads:
        raise ValueError(f"keep must be in [1, {num_heads}], got {keep}")
    return {i: sorted(rng.sample(range(num_heads), num_heads - keep)) for i in range(num_layers)}


def flops(model: SentenceEncoder, B: int, T: int) -> tuple[int, int]:
    """(attention FLOPs, MLP FLOPs) of the encoder's layers for one [B, T] batch."""
    config = model.encoder.config
    attention = sum(layer.cost(T, batch=B).total_flops for layer in attention_layers(model))
    mlp = config.num_layers * 4 * B * T * config.hidden_size * config.intermediate_size  # two C x I matmuls
    return attention, mlp


def time_shares(model: SentenceEncoder, tok: Tokenized, passes: int) -> tuple[float, float]:
    """Fractions of encode time inside attention modules and inside MLPs (hooks; diagnostic)."""
    spent = {"attention": 0.0, "mlp": 0.0}
    start: dict[str, float] = {}
    handles = []

    def enter(name):
        return lambda *_: start.__setitem__(name, time.perf_counter())

    def leave(name):
        return lambda *_: spent.__setitem__(name, spent[name] + time.perf_counter() - start[name])

    for layer in model.encoder.layers:
        handles += [
            layer.attention.register_forward_pre_hook(enter("attention")),
            layer.attention.register_forward_hook(leave("attention")),
            layer.intermediate.register_forward_pre_hook(enter("mlp")),
            layer.output.register_forward_hook(leave("mlp")),
        ]
    try:
        total = 0.0
        with torch.inference_mode():
            for _ in range(passes):
                t0 = time.perf_counter()
                model(tok.input_ids, tok.attention_mask, tok.token_type_ids)
                total += time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    return spent["attention"] / total, spent["mlp"] / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", type=int, nargs="+", default=[10, 8, 6, 4, 2, 1])
    parser.add_argument("--lines", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--number", type=int, default=2)
    args = parser.parse_args()

    base = load_minilm().eval()
    L, H = base.encoder.config.num_layers, base.encoder.config.num_heads
    tok = base.tokenize(batch_lines(base, args.lines, args.max_tokens, args.seed))
    B, T = tok.input_ids.shape
    rng = random.Random(args.seed)
    variants: dict[str, tuple[int, SentenceEncoder]] = {"keep 12 (unpruned)": (H, base)}
    with torch.inference_mode():
        reference = base(tok.input_ids, tok.attention_mask, tok.token_type_ids)  # (B, C)
    for keep in args.keep:
        table = prune_table(L, H, keep, rng)
        pruned = prune_heads(copy.deepcopy(base), table).eval()
        with torch.inference_mode():
            with mask_heads(base, table):
                masked = base(tok.input_ids, tok.attention_mask, tok.token_type_ids)  # (B, C)
            # different shapes (fewer heads): a float32 tolerance, not bitwise
            torch.testing.assert_close(pruned(tok.input_ids, tok.attention_mask, tok.token_type_ids), masked)
        variants[f"keep {keep}"] = (keep, pruned)
    assert not torch.equal(reference, masked)  # internal check: the last copy really lost heads

    def step(model):
        def run() -> None:
            with torch.inference_mode():
                model(tok.input_ids, tok.attention_mask, tok.token_type_ids)

        return run

    print(f"batch {B} lines x T = {T} (padded; {int(tok.attention_mask.sum())} real tokens), seed {args.seed}")
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{args.warmup} warm-up + {args.rounds} rounds x {args.number} calls")  # fmt: skip
    for n in args.threads:
        with threads(n):
            load_before = os.getloadavg()
            t0 = time.perf_counter()
            times = time_alternating({name: step(m) for name, (_, m) in variants.items()},
                                     warmup=args.warmup, rounds=args.rounds, number=args.number)  # fmt: skip
            wall = time.perf_counter() - t0
            load_after = os.getloadavg()
            att_share, mlp_share = time_shares(base, tok, passes=10)
        print(f"\n### {n} thread(s): {wall:.0f} s, load average (1, 5, 15 min) "
              f"before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
              f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")  # fmt: skip
        print(f"unpruned time share (hooks, 10 passes): attention {att_share:.1%}, MLP {mlp_share:.1%}, "
              f"rest {1 - att_share - mlp_share:.1%}; bound with every head gone: "
              f"{1 / (1 - att_share):.2f}x\n")  # fmt: skip
        print("| variant | pruned | parameters | attention GFLOPs | MLP GFLOPs | median ms/batch [IQR] "
              "| per-round ratio to unpruned: median [IQR] | speed-up |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        baseline = times["keep 12 (unpruned)"]
        for name, (keep, model) in variants.items():
            ms = [t * 1e3 for t in times[name]]
            q1, _, q3 = statistics.quantiles(ms, n=4, method="inclusive")
            ratios = [a / b for a, b in zip(times[name], baseline)]
            r1, rm, r3 = statistics.quantiles(ratios, n=4, method="inclusive")
            att, mlp = flops(model, B, T)
            params = sum(p.numel() for p in model.parameters())
            print(f"| {name} | {1 - keep / H:.0%} | {params:,} | {att / 1e9:.3f} | {mlp / 1e9:.3f} "
                  f"| {statistics.median(ms):.1f} [{q1:.1f}-{q3:.1f}] | {rm:.3f} "
                  f"[{r1:.3f}-{r3:.3f}] | {1 / rm:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
