"""MHA -> MLA conversion of the pretrained all-MiniLM-L6-v2 against MHA -> GQA of equal KV-cache bytes.

    .venv/bin/python -m benchmarks.minilm_mla [--heldout 2000] [--calib-lines 256] [--ranks 64,128,192,256,384]

Data and measure as ``benchmarks.minilm_gqa`` (``minilm_pruning.load_lines``:
Shakespeare's works split by title, no line on both sides): calibration =
the first lines of the first ``--calib-lines`` calibration pairs, padded per
batch of ``--batch-size``; fidelity on ``--heldout`` held-out lines
(``tools.fidelity``): mean cosine between converted and original
embeddings, and top-10 nearest-neighbour agreement. No training after any
conversion.

An "mla" layer caches r elements per token (its latent, absorbed path); a
GQA layer 2·G·D. With D = 32, r = 64·G holds the same bytes as G key/value
heads, so every rank r of ``--ranks`` is set against G = r / 64 where that
divides H = 12 (r = 64, 128, 192, 256, 384: G = 1, 2, 3, 4, 6). Each rank is
converted by ``tools.convert_mla.to_mla`` with "svd" and "activation"
(calibrated on the calibration lines), each G by ``to_gqa`` with "mean" and
"aligned" (the same lines). KV bytes per token over the 6 layers in float32
come from the kinds' ``cost()`` (``tools.flops.kv_cache_size``). Prints a
markdown table.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.minilm_pruning import load_lines
from multihead.models.minilm import load_minilm
from multihead.tools.convert_heads import to_gqa
from multihead.tools.convert_mla import to_mla
from multihead.tools.fidelity import fidelity
from multihead.tools.flops import kv_cache_size


def _row(name: str, budget: str, new, reference, heldout, batch_size: int, seconds: float) -> str:
    cos, agree = fidelity(reference, new.encode(heldout, batch_size=batch_size))
    params = sum(p.numel() for p in new.encoder.parameters())
    return (f"| {name} | {budget} | {cos:.4f} | {agree:.3f} | {kv_cache_size(new).bytes_per_token:,} | "
            f"{params:,} | {seconds:.1f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calib-lines", type=int, default=256, help="calibration lines ('activation', 'aligned')")
    parser.add_argument("--heldout", type=int, default=2000, help="held-out lines")
    parser.add_argument("--ranks", default="64,128,192,256,384", help="latent ranks r, comma-separated")
    parser.add_argument("--no-gqa", action="store_true", help="leave out the GQA rows")
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
    H, D = model.encoder.config.num_heads, model.encoder.config.head_dim
    print(f"calibration: {len(calib)} lines in {len(calibration)} padded batches; held-out: {len(lines.heldout)} lines")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    reference = model.encode(lines.heldout, batch_size=args.batch_size)  # (N, C)
    print("| model | r / G | mean cos | NN@10 | KV cache bytes/token (fp32, 6 layers) | parameters | convert s |")
    print("|---|---|---|---|---|---|---|")
    params = sum(p.numel() for p in model.encoder.parameters())
    print(f"| original (mha) | G = {H} | 1 | 1 | {kv_cache_size(model).bytes_per_token:,} | {params:,} | - |")
    for r in (int(x) for x in args.ranks.split(",")):
        for method in ("svd", "activation"):
            start = time.perf_counter()
            new = to_mla(model, r, method=method, calibration=calibration if method == "activation" else None)
            row = _row(f"{method} -> mla", f"r = {r}", new, reference, lines.heldout, args.batch_size,
                       time.perf_counter() - start)  # fmt: skip
            print(row, flush=True)
        G, rest = divmod(r, 2 * D)
        if args.no_gqa or rest or G < 1 or H % G or G >= H:
            continue
        for method in ("mean", "aligned"):
            start = time.perf_counter()
            new = to_gqa(model, G, method=method, calibration=calibration if method == "aligned" else None)
            row = _row(f"{method} -> {new.encoder.config.attention}", f"G = {G}", new, reference, lines.heldout,
                       args.batch_size, time.perf_counter() - start)  # fmt: skip
            print(row, flush=True)
    print(f"\nwall time {time.perf_counter() - begin:.0f} s")


if __name__ == "__main__":
    main()
