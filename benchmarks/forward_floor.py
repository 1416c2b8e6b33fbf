"""The forward against its FLOP floor, and where the time goes.

    python -m benchmarks.forward_floor [--batch 8 --seq 1024 --embed-dim 768 --heads 12]
                                       [--non-causal] [--no-bias] [--threads N] [--rounds 7]

One ``multihead.MultiHeadAttention`` forward (eval, ``no_grad``; causal by
default; projections with biases unless ``--no-bias``) at the book
configuration (B=8, T=1024, C=768, H=12, float32):

* FLOPs from the module's own cost accounting (``cost(T, batch=B,
  causal=...)``: projections and attention core, matrix products only,
  visible pairs only);
* the GEMM peak measured in the same rounds as the forward: each round
  times the best of two 2048 x 2048 float32 matrix products (the size
  ``multihead.tools.machine_limits`` uses on CPU), then one forward, so a
  shared machine's load falls on both; the FLOP floor of a round is
  FLOPs / that round's peak, and the figure reported is the median over
  rounds of forward time / floor. The cached peak of ``machine_limits``
  (measured once, maybe on a quieter machine) is printed beside it;
* the median forward time of ``--rounds`` calls (after one warm-up);
* a profile (``torch.profiler``, median over the rounds of each operator's
  self CPU time) grouped into projections (``addmm``/``mm``), the attention
  kernel (SDPA), the non-finite check (``sum``, ``isfinite``, the host
  sync), layout (copies, views, concatenation) and the rest, each with its
  share of the FLOPs, its FLOP/s and its own floor multiple.

A diagnostic: the profiler adds overhead, so the floor multiple of the
first table (unprofiled calls) is the figure to quote.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import multihead
from multihead.tools.machine_limits import machine_limits

from .run import load_average

GROUPS = (
    ("projections (addmm, mm)", ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul")),
    ("attention kernel (SDPA)", ("scaled_dot_product",)),
    ("non-finite check (sum, isfinite, host sync)", ("aten::sum", "aten::isfinite", "aten::all", "aten::item",
                                                     "aten::_local_scalar_dense", "aten::is_nonzero")),
    ("layout (copies, views, cat)", ("aten::copy_", "aten::cat", "aten::clone", "aten::contiguous", "aten::view",
                                     "aten::reshape", "aten::transpose", "aten::permute", "aten::split",
                                     "aten::unbind", "aten::select", "aten::slice", "aten::as_strided",
                                     "aten::empty", "aten::unflatten", "aten::_reshape_alias", "aten::t",
                                     "aten::expand", "aten::unsqueeze", "aten::narrow", "aten::empty_like")),
)  # fmt: skip


def group_of(op: str) -> str:
    for name, keys in GROUPS:
        if any(op == k or (not k.startswith("aten::") and k in op) for k in keys):
            return name
    return "other"


def measure(args) -> dict:
    torch.manual_seed(0)
    B, T, C, H = args.batch, args.seq, args.embed_dim, args.heads
    m = multihead.MultiHeadAttention(C, H, qkv_bias=not args.no_bias, out_bias=not args.no_bias).eval()
    x = torch.randn(B, T, C)
    causal = not args.non_causal
    cost = m.cost(T, batch=B, causal=causal)
    limits = machine_limits("cpu", ["float32"])
    peak = limits.peak_flops["float32"]

    def forward() -> None:
        with torch.no_grad():
            m(x, is_causal=causal)

    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    forward()
    a @ b
    times, peaks = [], []
    for _ in range(args.rounds):
        gemm = []
        for _ in range(2):
            start = time.perf_counter()
            a @ b
            gemm.append(time.perf_counter() - start)
        peaks.append(2 * n**3 / min(gemm))
        start = time.perf_counter()
        forward()
        times.append(time.perf_counter() - start)
    per_op: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.rounds):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            forward()
        for event in prof.key_averages():
            per_op[event.key].append(event.self_cpu_time_total / 1e6)
    groups: dict[str, float] = defaultdict(float)
    for op, xs in per_op.items():
        groups[group_of(op)] += statistics.median(xs)
    return {"cost": cost, "peak": statistics.median(peaks), "cached_peak": peak, "limits": limits, "times": times,
            "multiples": [t / (cost.total_flops / p) for t, p in zip(times, peaks)], "groups": dict(groups),
            "ops": {op: statistics.median(xs) for op, xs in per_op.items()}}  # fmt: skip


def report(args, r: dict) -> str:
    cost, peak = r["cost"], r["peak"]
    median = statistics.median(r["times"])
    floor = cost.total_flops / peak
    cached = r["cached_peak"]
    multiples = sorted(r["multiples"])
    lines = [
        f"B={args.batch}, T={args.seq}, C={args.embed_dim}, H={args.heads}, "
        f"{'non-causal' if args.non_causal else 'causal'}, {'no biases' if args.no_bias else 'biases'}, float32, "
        f"{torch.get_num_threads()} threads; "
        f"GEMM peak in these rounds (median) {peak / 1e9:.1f} GFLOP/s; cached by machine_limits "
        f"{cached / 1e9:.1f} GFLOP/s ({r['limits'].device}, measured {r['limits'].date}); load {load_average()}",
        "",
        "| FLOPs (GFLOP): projections + core = total | FLOP floor ms | forward median ms (min-max) "
        "| x floor, per round: median (min-max) | x cached-peak floor |",
        "|---|---|---|---|---|",
        f"| {cost.projection_flops / 1e9:.2f} + {cost.core_flops / 1e9:.2f} = {cost.total_flops / 1e9:.2f} "
        f"| {floor * 1e3:.1f} | {median * 1e3:.1f} ({min(r['times']) * 1e3:.1f}-{max(r['times']) * 1e3:.1f}) "
        f"| {statistics.median(multiples):.2f}x ({multiples[0]:.2f}-{multiples[-1]:.2f}) "
        f"| {median / (cost.total_flops / cached):.2f}x |",
        "",
        "| where the time goes (profiled) | self CPU ms | share | GFLOP | GFLOP/s | x its floor |",
        "|---|---|---|---|---|---|",
    ]
    total = sum(r["groups"].values())
    flops = {GROUPS[0][0]: cost.projection_flops, GROUPS[1][0]: cost.core_flops}
    for name in [g[0] for g in GROUPS] + ["other"]:
        s = r["groups"].get(name, 0.0)
        f = flops.get(name)
        extra = f"| {f / 1e9:.2f} | {f / s / 1e9:.1f} | {s / (f / peak):.2f}x |" if f and s else "| - | - | - |"
        lines.append(f"| {name} | {s * 1e3:.1f} | {s / total:.1%} {extra}")
    lines.append(f"| total | {total * 1e3:.1f} | 100% | {cost.total_flops / 1e9:.2f} "
                 f"| {cost.total_flops / total / 1e9:.1f} | {total / floor:.2f}x |")  # fmt: skip
    top = sorted(r["ops"].items(), key=lambda kv: -kv[1])[: args.top]
    lines += ["", "| op | self CPU ms (median) | group |", "|---|---|---|"]
    lines += [f"| `{op}` | {s * 1e3:.2f} | {group_of(op)} |" for op, s in top]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.forward_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--embed-dim", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--no-bias", action="store_true", help="projections without biases (as attention_peers)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's own)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--top", type=int, default=10, help="operators listed one by one")
    args = parser.parse_args(argv)
    if min(args.batch, args.seq, args.embed_dim, args.heads, args.rounds) < 1 or args.embed_dim % args.heads:
        print("sizes and --rounds must be positive and --heads must divide --embed-dim", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    print(report(args, measure(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
