"""Host synchronisations in attention on CUDA, and what they cost.

    PYTHONPATH=src python3 -m benchmarks.cuda_syncs [--batch 8 --seq 1024 --cache 1024 --dtype bfloat16]

Two shapes, each timed in its two forms, alternating in one process: the
eager form (reads the data back before choosing a branch: one sync per call
here; the default) and the branch-free form compiled code runs, forced in
eager mode (no host read, more kernels; ``functional.host_sync``), beside
bare SDPA:

* a prefill: one causal ``MultiHeadAttention`` forward of B x T tokens
  (C=768, H=12), against its projections around bare SDPA;
* a decode step's attention: ``functional.attention`` of one query per row
  against ``--cache`` cached keys (bottom-right causal), against bare SDPA.

Before timing, the host syncs the profiler sees in one call of each form
(``aten::_local_scalar_dense``, stream and device synchronisations) are listed.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from multihead import MultiHeadAttention
from multihead.functional import attention, host_sync

from .timing import cuda_ms

SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item")


def _branch_free(call):
    """``call`` in the form compiled code runs: no look at the data, no host sync."""
    original = host_sync.sync_free

    def run():
        host_sync.sync_free = lambda: True
        try:
            return call()
        finally:
            host_sync.sync_free = original

    return run


def _prefill(a, dtype):
    """(multihead forward, bare floor) of the book layer."""
    m = MultiHeadAttention(768, 12, device="cuda", dtype=dtype).eval()
    x = torch.randn(a.batch, a.seq, 768, device="cuda", dtype=dtype)

    def floor():
        qkv = F.linear(x, m.qkv_proj.weight, m.qkv_proj.bias)
        q, k, v = qkv.view(a.batch, a.seq, 3, 12, 64).permute(2, 0, 3, 1, 4)  # (B, T, 3C) -> 3 x (B, H, T, D)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(o.transpose(1, 2).reshape(a.batch, a.seq, 768), m.out_proj.weight, m.out_proj.bias)

    return (lambda: m(x, is_causal=True)), floor


def _decode(a, dtype):
    """(multihead attention, bare SDPA) of one query per row against a cache."""
    q = torch.randn(a.batch, 12, 1, 64, device="cuda", dtype=dtype)
    k, v = (torch.randn(a.batch, 12, a.cache, 64, device="cuda", dtype=dtype) for _ in range(2))

    def ours():
        return attention(q, k, v, is_causal=True, causal_alignment="bottom_right")

    return ours, (lambda: F.scaled_dot_product_attention(q, k, v))


def _compare(title: str, ours, floor, a) -> None:
    contenders = {"multihead (eager: check first, the default)": ours,
                  "multihead (branch-free, no sync)": _branch_free(ours), "bare sdpa": floor}  # fmt: skip
    torch.testing.assert_close(ours().float(), floor().float(), atol=2e-2, rtol=2e-2)
    for f in contenders.values():
        f()
    torch.cuda.synchronize()
    for name in list(contenders)[:2]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            contenders[name]()
        counts = {e.key: e.count for e in prof.key_averages() if e.key in SYNC_EVENTS}
        print(f"{title}, {name}: host syncs in one call: {counts or 'none'}")
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(a.rounds):
        for name, f in contenders.items():
            times[name].append(cuda_ms(f, a.number))
    base = statistics.median(times["bare sdpa"])
    print(f"\n{title}: {torch.cuda.get_device_name()}, {a.dtype}, {a.rounds} rounds of {a.number} calls, alternating")
    print("| contender | median ms | / bare sdpa |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.4f} | {statistics.median(t) / base:.2f} |")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--cache", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--number", type=int, default=20)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        _compare(f"prefill, MultiHeadAttention B={a.batch} T={a.seq} C=768 H=12 causal", *_prefill(a, dtype), a)
        _compare(f"decode attention, B={a.batch} H=12 D=64, 1 query against {a.cache} keys", *_decode(a, dtype), a)


if __name__ == "__main__":
    main()
