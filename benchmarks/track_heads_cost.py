"""What ``--track-heads`` adds to an evaluation: one head scoring against the validation pass.

    .venv/bin/python -m benchmarks.track_heads_cost [--preset mini] [--context 128] [--threads 1] [--rounds 10]

Times, alternating round by round in one process (``benchmarks.timing``),
on a fresh GPT of the preset with the run's default sizes (batch 32,
``eval_batches`` 20, bytes):

    train step   one AdamW step on [32, T] (forward, backward, update)
    validation   ``validation_loss`` over 20 batches [32, T]: what every evaluation costs already
    head scores  ``tracked_heads``: one captured forward of [8, 2n], n = min(32, T // 2)

and prints their medians and the per-round ratio of head scores to the
validation pass (and to a training step).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.timing import compare, fmt_ms, summarize, threads, time_alternating
from multihead.models.gpt import GPT
from multihead.train import TrainConfig
from multihead.train.batches import val_batches
from multihead.train.head_tracking import seen_ids, tracked_heads
from multihead.train.steps import parameter_groups, validation_loss
from multihead.train.world import World


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="mini")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    config = TrainConfig(preset=args.preset, context_length=args.context, track_heads=True, out="/tmp/unused")
    torch.manual_seed(0)
    model = GPT(config.model_config(256))
    tokens = np.random.default_rng(0).integers(0, 90, size=200_000)
    sets = val_batches(tokens, batch_size=config.batch_size, context_length=config.context_length,
                       num_batches=config.eval_batches, seed=0)  # fmt: skip
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-4)
    x, y = sets[0]
    ids = seen_ids(tokens, 256)
    autocast = lambda: torch.autocast("cpu", enabled=False)  # noqa: E731

    def train_step() -> None:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    steps = {
        "train step": train_step,
        "validation": lambda: validation_loss(model, sets, config, World(), torch.device("cpu"), autocast),
        "head scores": lambda: tracked_heads(model, ids, config.context_length),
    }
    with threads(args.threads):
        times = time_alternating(steps, warmup=2, rounds=args.rounds)
    print(f"{args.preset} at context {args.context}, {args.threads} thread(s), {args.rounds} rounds")
    for name, xs in times.items():
        s = summarize(xs)
        print(f"  {name:<12} median {fmt_ms(s['median'])} ms (quartiles {fmt_ms(s['q1'])}..{fmt_ms(s['q3'])})")
    for base in ("validation", "train step"):
        c = compare(times["head scores"], times[base])
        print(f"  head scores / {base}: {c['ratio_of_medians']:.4f} (per-round median {c['per_round']['median']:.4f})")


if __name__ == "__main__":
    main()
