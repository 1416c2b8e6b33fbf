"""MHA -> GQA conversion of the pretrained all-MiniLM-L6-v2: how well sentence embeddings survive.

    .venv/bin/python -m benchmarks.minilm_gqa [--heldout 2000] [--calib-lines 256]

Data as in ``benchmarks.minilm_pruning`` (``load_lines``: Shakespeare's works
split by title, even positions calibrate, odd positions are held out, no
line on both sides): the calibration lines are the first lines of the first
``--calib-lines`` calibration pairs, tokenised and padded per batch by the
model (padding is left out of the key/value statistics); the held-out lines
are ``--heldout`` distinct lines of the other works.

For G in {6, 4, 3, 2, 1} (the divisors of H = 12 below 12), every layer is
converted by ``tools.convert_heads.to_gqa`` with "mean" and "aligned", no
recovery training. Fidelity on the held-out lines (``tools.fidelity``):
mean cosine between converted and original embeddings, and top-10
nearest-neighbour agreement. Also: parameters of the encoder and KV-cache
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


def _kv_bytes(model) -> int:
    return sum(layer.attention.cost(1, bytes_per_element=4).kv_cache_bytes_per_token for layer in model.encoder.layers)


def _parameters(model) -> int:
    return sum(p.numel() for p in model.encoder.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib-lines", type=int, default=256, help="calibration lines for 'aligned'")
    parser.add_argument("--heldout", type=int, default=2000, help="held-out lines")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--min-words", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    begin = time.perf_counter()
    model = load_minilm()
    args.calib_pairs = args.calib_lines
    lines = load_lines(model, args)
    calib = [a for a, _ in lines.calib_pairs]
    calibration = [calib[i : i + args.batch_size] for i in range(0, len(calib), args.batch_size)]  # lists of str
    H = model.encoder.config.num_heads
    print(f"calibration: {len(calib)} lines in {len(calibration)} padded batches; held-out: {len(lines.heldout)} lines")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    reference = model.encode(lines.heldout, batch_size=args.batch_size)  # (N, C)
    print("| model | G | mean cos | NN@10 | KV cache bytes/token (fp32, 6 layers) | parameters | convert s |")
    print("|---|---|---|---|---|---|---|")
    print(f"| original (mha) | {H} | 1 | 1 | {_kv_bytes(model)} | {_parameters(model)} | - |")
    for G in sorted((g for g in range(1, H) if H % g == 0), reverse=True):
        for method in ("mean", "aligned"):
            start = time.perf_counter()
            new = to_gqa(model, G, method=method, calibration=calibration if method == "aligned" else None)
            seconds = time.perf_counter() - start
            cos, agree = fidelity(reference, new.encode(lines.heldout, batch_size=args.batch_size))
            print(
                f"| {method} -> {new.encoder.config.attention} | {G} | {cos:.4f} | {agree:.3f} | "
                f"{_kv_bytes(new)} | {_parameters(new)} | {seconds:.1f} |",
                flush=True,
            )
    print(f"\nwall time {time.perf_counter() - begin:.0f} s")


if __name__ == "__main__":
    main()
