"""MHA -> GQA conversion of the pretrained all-MiniLM-L6-v2: how well sentence embeddings survive.

    .venv/bin/python -m benchmarks.minilm_gqa [--heldout 2000] [--calib-lines 256]

Data as in ``benchmarks.minilm_pruning`` (``load_lines``: Shakespeare's works
split by title, even positions calibrate, odd positions are held out, no
line on both sides): the calibration lines are the first lines of the first
``--calib-lines`` calibration pairs, tokenised and padded per batch by the
model (padding is left out of the key/value statistics); the held-out lines
are ``--heldout`` distinct lines of the other works.

For G in {6, 4, 3, 2, 1} (the divisors of H = 12 below 12), every layer is
converted by ``tools.convert_heads.to_gqa`` with "mean" and "aligned", then
given a short recovery training (``tools.recovery.recover``, objective
"cosine": the converted encoder's embeddings distilled towards the
original's) on the calibration lines only, sorted by length and batched by
``--recover-batch-size`` (less padding), ``--recover-steps`` AdamW steps at
peak rate ``--recover-lr`` (0 steps: no recovery). Fidelity on the held-out
lines (``tools.fidelity``), before and after recovery: mean cosine between
converted and original embeddings, and top-10 nearest-neighbour agreement. Also: parameters of the encoder and KV-cache
bytes per token (``cost()`` of every layer, float32 elements; an encoder
keeps no cache, the figure is what a cache of its keys and values would
hold). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.minilm_pruning import load_lines
from multihead.models.minilm import load_minilm
from multihead.tools.convert_heads import to_gqa
from multihead.tools.fidelity import fidelity
from multihead.tools.flops import kv_cache_size
from multihead.tools.recovery import recover


def _kv_bytes(model) -> int:
    return kv_cache_size(model).bytes_per_token  # float32 weights: 4 bytes per element, as the commands print it


def _parameters(model) -> int:
    return sum(p.numel() for p in model.encoder.parameters())


def _embed(model, batch):
    return model(batch.input_ids, batch.attention_mask, batch.token_type_ids)  # (B, C)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib-lines", type=int, default=256, help="calibration lines for 'aligned'")
    parser.add_argument("--heldout", type=int, default=2000, help="held-out lines")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--min-words", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recover-steps", type=int, default=32, help="recovery steps (0: none)")
    parser.add_argument("--recover-lr", type=float, default=3e-4, help="peak learning rate of the recovery")
    parser.add_argument("--recover-batch-size", type=int, default=32)
    args = parser.parse_args()
    begin = time.perf_counter()
    model = load_minilm()
    args.calib_pairs = args.calib_lines
    lines = load_lines(model, args)
    calib = [a for a, _ in lines.calib_pairs]
    calibration = [calib[i : i + args.batch_size] for i in range(0, len(calib), args.batch_size)]  # lists of str
    by_length = sorted(calib, key=lambda line: len(model.tokenizer.encode(line).ids))
    size = args.recover_batch_size
    train = [model.tokenize(by_length[i : i + size]) for i in range(0, len(by_length), size)]  # (B, T) ids, masks
    H = model.encoder.config.num_heads
    print(f"calibration: {len(calib)} lines in {len(calibration)} padded batches; held-out: {len(lines.heldout)} lines")
    print(
        f"recovery: {args.recover_steps} steps, lr {args.recover_lr}, cosine objective, "
        f"{len(train)} batches of {size} calibration lines"
    )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    reference = model.encode(lines.heldout, batch_size=args.batch_size)  # (N, C)
    print(
        "| model | G | mean cos | NN@10 | recovered cos | recovered NN@10 | KV cache bytes/token (fp32, 6 layers) "
        "| parameters | convert s | recovery s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| original (mha) | {H} | 1 | 1 | 1 | 1 | {_kv_bytes(model)} | {_parameters(model)} | - | - |")
    for G in sorted((g for g in range(1, H) if H % g == 0), reverse=True):
        for method in ("mean", "aligned"):
            start = time.perf_counter()
            new = to_gqa(model, G, method=method, calibration=calibration if method == "aligned" else None)
            seconds = time.perf_counter() - start
            cos, agree = fidelity(reference, new.encode(lines.heldout, batch_size=args.batch_size))
            after, recover_s = "- | -", "-"
            if args.recover_steps > 0:
                start = time.perf_counter()
                recover(new, model, train, _embed, steps=args.recover_steps, lr=args.recover_lr,
                        objective="cosine", progress=False, seed=args.seed)  # fmt: skip
                recover_s = f"{time.perf_counter() - start:.1f}"
                r_cos, r_agree = fidelity(reference, new.encode(lines.heldout, batch_size=args.batch_size))
                after = f"{r_cos:.4f} | {r_agree:.3f}"
            print(
                f"| {method} -> {new.encoder.config.attention} | {G} | {cos:.4f} | {agree:.3f} | {after} | "
                f"{_kv_bytes(new)} | {_parameters(new)} | {seconds:.1f} | {recover_s} |",
                flush=True,
            )
    print(f"\nwall time {time.perf_counter() - begin:.0f} s")


if __name__ == "__main__":
    main()
