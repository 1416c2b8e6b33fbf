"""Copies before CUDA's fused kernels: what passing aligned strided views saves.

    PYTHONPATH=src python3 -m benchmarks.cuda_views [--rounds 9 --number 20]

The "copy" form (the former rule) copies every CUDA tensor that is not contiguous
from a 16-byte aligned start; q, k and v of a ``MultiHeadAttention`` forward are
views of its fused projection, so each forward copied all three. The "views" form,
``functional.lse_backend.cuda_kernel_inputs`` now, passes a view on when its last
stride is 1 and its start and other strides are multiples of 16 bytes. This script first checks both forms against a
float64 CPU forward with the same weights (plain and ``return_weights=True``, several
head widths, aligned and not), then times them alternating in one process.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from multihead import MultiHeadAttention
from multihead.functional import lse_backend, sdpa_backend

from .timing import cuda_ms

VIEWS = lse_backend.cuda_kernel_inputs  # the rule in use


def copies(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The former rule: every CUDA tensor not contiguous from a 16-byte aligned start is copied."""

    def ready(t: torch.Tensor) -> torch.Tensor:
        if not t.is_cuda or (t.is_contiguous() and t.data_ptr() % 16 == 0):
            return t
        return t.clone(memory_format=torch.contiguous_format)

    return tuple(ready(t) for t in tensors)


def use(rule) -> None:
    lse_backend.cuda_kernel_inputs = rule
    sdpa_backend.cuda_kernel_inputs = rule


def check(dtype: torch.dtype) -> None:
    """Both forms against float64 on the CPU; the views form no worse than the copy form."""
    for C, H, causal in [(768, 12, True), (40, 5, True), (36, 3, False), (96, 6, False), (200, 5, True)]:
        m = MultiHeadAttention(C, H).double()
        x = torch.randn(3, 37, C, dtype=torch.float64)
        ref, ref_w = m(x, is_causal=causal, return_weights=True)
        g = MultiHeadAttention(C, H, device="cuda", dtype=dtype)
        g.load_state_dict(m.state_dict())
        errs = {}
        for name, rule in (("copy", copies), ("views", VIEWS)):
            use(rule)
            out = g(x.to("cuda", dtype), is_causal=causal)
            out_w, w = g(x.to("cuda", dtype), is_causal=causal, return_weights=True)
            errs[name] = max((out.double().cpu() - ref).abs().max().item(), (out_w.double().cpu() - ref).abs().max().item(),
                             (w.double().cpu() - ref_w).abs().max().item())  # fmt: skip
        use(VIEWS)
        ok = errs["views"] <= 1.5 * errs["copy"] + 1e-6
        print(
            f"C={C} H={H} causal={causal} {dtype}: max error copy {errs['copy']:.2e} views {errs['views']:.2e} {'ok' if ok else 'WORSE'}"
        )
        if not ok:
            raise SystemExit(f"views form is worse than the copy form at C={C} H={H}")


def timing(B: int, T: int, dtype: torch.dtype, a) -> None:
    m = MultiHeadAttention(768, 12, device="cuda", dtype=dtype).eval()
    x = torch.randn(B, T, 768, device="cuda", dtype=dtype)
    times: dict[str, list[float]] = {"copy": [], "views": []}
    for rule in (copies, VIEWS):
        use(rule)
        m(x, is_causal=True)
    for _ in range(a.rounds):
        for name, rule in (("copy", copies), ("views", VIEWS)):
            use(rule)
            times[name].append(cuda_ms(lambda: m(x, is_causal=True), a.number))
    use(VIEWS)
    c, v = statistics.median(times["copy"]), statistics.median(times["views"])
    print(f"| B={B} T={T} C=768 H=12 causal {dtype} | {c:.4f} | {v:.4f} | {v / c:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--number", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            check(dtype)
        print(f"\n{torch.cuda.get_device_name()}, {a.rounds} rounds of {a.number} calls, alternating")
        print("| forward | copy ms | views ms | views / copy |\n|---|---|---|---|")
        for B, T in [(8, 1024), (1, 128), (8, 1)]:
            timing(B, T, torch.bfloat16, a)


if __name__ == "__main__":
    main()
