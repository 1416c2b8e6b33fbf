"""Host synchronisations in one attention forward on CUDA, and what they cost.

    PYTHONPATH=src python3 -m benchmarks.cuda_syncs [--batch 8 --seq 1024 --dtype bfloat16]

Lists the host syncs (``aten::_local_scalar_dense``, stream and device
synchronisations) the profiler sees in one ``MultiHeadAttention`` forward,
then times the forward in its two forms, alternating in one process: the
sync-free form (no host read; the default off the CPU, ``functional.host_sync``)
and the check-first form the CPU runs (reads the data back before choosing a
branch: one sync per call here), beside bare SDPA.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from multihead import MultiHeadAttention
from multihead.functional import host_sync

SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::item")


def _time(fn, number: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(number):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / number


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--number", type=int, default=20)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(0)
    m = MultiHeadAttention(768, 12, device="cuda", dtype=dtype).eval()
    x = torch.randn(a.batch, a.seq, 768, device="cuda", dtype=dtype)
    w_in, w_out = m.qkv_proj.weight, m.out_proj.weight

    def floor():
        q, k, v = F.linear(x, w_in, m.qkv_proj.bias).view(a.batch, a.seq, 3, 12, 64).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(o.transpose(1, 2).reshape(a.batch, a.seq, 768), w_out, m.out_proj.bias)

    original = host_sync.sync_free

    def ours():  # the default on a GPU: sync-free
        return m(x, is_causal=True)

    def check_first():  # the CPU's form: look at the data, then branch (a host sync here)
        host_sync.sync_free = lambda device: False
        try:
            return m(x, is_causal=True)
        finally:
            host_sync.sync_free = original

    with torch.no_grad():
        torch.testing.assert_close(ours().float(), floor().float(), atol=2e-2, rtol=2e-2)
        for f in (ours, check_first, floor):
            f()
        torch.cuda.synchronize()
        for name, f in (("multihead (sync-free, the default)", ours), ("multihead (check first)", check_first)):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                f()
                torch.cuda.synchronize()
            counts = {e.key: e.count for e in prof.key_averages() if e.key in SYNC_EVENTS}
            print(f"{name}: host syncs in one forward: {counts or 'none'}")
        times: dict[str, list[float]] = {"multihead (sync-free, the default)": [], "multihead (check first)": [],
                                         "bare sdpa": []}  # fmt: skip
        for _ in range(a.rounds):
            for name, f in zip(times, (ours, check_first, floor)):
                times[name].append(_time(f, a.number))
    base = statistics.median(times["bare sdpa"])
    print(f"\n{torch.cuda.get_device_name()}, B={a.batch} T={a.seq} C=768 H=12 causal {a.dtype}, "
          f"{a.rounds} rounds of {a.number} calls, alternating")
    print("| contender | median ms | / bare sdpa |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.3f} | {statistics.median(t) / base:.2f} |")


if __name__ == "__main__":
    main()
