"""DCMHA forward: unchunked (full (B, H, T, S) composition) vs chunked over queries.

Sizes: embed 512, 8 heads, B=1, float32, CPU, causal self-attention, eval
mode under ``torch.no_grad()``. The two contenders are the same module
(``multihead.modules.kinds.dcmha.DCMHA``) with ``chunk_size`` = T (unchunked, what
the official DCFormer prefill does) and ``chunk_size`` = 128.

Timing goes through the usual harness. Peak memory is measured honestly in
a fresh subprocess per (T, contender): the process builds the module and
input, records VmHWM (peak resident set, from /proc/self/status), resets it
(writing "5" to /proc/self/clear_refs) and runs one forward; the figure is
the new VmHWM minus the resident set before the forward. Each scenario
prints its memory line to stderr, and::

    .venv/bin/python -m benchmarks.cases.dcmha_memory [T ...]

prints a markdown table (default T = 2048 4096).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch

from ..registry import register

CHUNK = 128

_PROBE = r"""
import sys, torch
from multihead.modules.kinds.dcmha import DCMHA
T, chunk = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(1)
torch.manual_seed(0)
m = DCMHA(512, 8, chunk_size=chunk).eval()
x = torch.randn(1, T, 512)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])  # kB
with torch.no_grad():
    m(x[:, :8], is_causal=True)  # warm up allocator and kernels
    rss = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    y = m(x, is_causal=True)
    peak = status("VmHWM:")
print((peak - rss) / 1024)
"""


def peak_forward_mib(T: int, chunk: int) -> float:
    """Peak extra resident memory (MiB) of one forward, in a fresh process."""
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, str(T), str(chunk)], capture_output=True, text=True, check=True
    )
    return float(res.stdout.strip().splitlines()[-1])


def build(config: dict[str, Any]):
    C, H, B, T = (int(config[k]) for k in ("embed_dim", "num_heads", "batch", "seq"))
    T //= int(config["seq_divisor"])  # --quick runs the scenarios at T / 8
    from multihead.modules.kinds.dcmha import DCMHA

    torch.manual_seed(int(config["seed"]))
    m = DCMHA(C, H, chunk_size=T).eval()
    x = torch.randn(B, T, C)
    return m, x


@register(
    "dcmha_memory",
    description=(
        "DCMHA forward (eval, no_grad, causal, embed 512, 8 heads, B=1, float32, CPU): unchunked "
        "vs chunked over 128-query blocks; peak memory of each in a fresh process is printed."
    ),
    config={"embed_dim": 512, "num_heads": 8, "batch": 1, "seq": 2048, "seed": 0, "chunk": CHUNK, "seq_divisor": 1,
            "memory": True, "warmup": 1, "rounds": 5, "number": 1},  # fmt: skip
    quick={"seq_divisor": 8, "chunk": 64, "warmup": 1, "rounds": 2},
    scenarios={"T=2048 (256 with --quick)": {"seq": 2048}, "T=4096 (512 with --quick)": {"seq": 4096}},
    baseline="unchunked",
)
def setup(config: dict[str, Any]) -> dict[str, Any]:
    m, x = build(config)
    T, chunk = x.shape[1], int(config["chunk"])
    with torch.no_grad():
        m.chunk_size = T
        full = m(x, is_causal=True)
        m.chunk_size = chunk
        torch.testing.assert_close(m(x, is_causal=True), full, msg="dcmha_memory: chunked != unchunked")
    if config["memory"]:
        a, b = peak_forward_mib(T, T), peak_forward_mib(T, chunk)
        print(f"dcmha_memory T={T}: peak forward memory unchunked {a:.0f} MiB, chunk {chunk} {b:.0f} MiB",
              file=sys.stderr)  # fmt: skip

    def run(size: int):
        def step() -> None:
            m.chunk_size = size
            with torch.no_grad():
                m(x, is_causal=True)

        return step

    return {"unchunked": run(T), f"chunked({chunk})": run(chunk)}


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv] or [2048, 4096]
    print("| T | unchunked peak (MiB) | chunked(128) peak (MiB) | ratio |")
    print("|---|---|---|---|")
    for T in sizes:
        a, b = peak_forward_mib(T, T), peak_forward_mib(T, CHUNK)
        print(f"| {T} | {a:.0f} | {b:.0f} | {a / b:.1f}x |")


if __name__ == "__main__":
    main(sys.argv[1:])
