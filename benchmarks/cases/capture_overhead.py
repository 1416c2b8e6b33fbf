"""A captured forward against an uncaptured one: what observing the weights costs.

Sizes: one GPT-2-small attention layer (``MultiHeadAttention(768, 12)``,
D = 64), B = 1, T = 1024, causal self-attention, float32, CPU, eval mode
under ``torch.no_grad()``. Contenders, all the same module and input:

* ``uncaptured``: the plain forward (the fused kernel, no weights);
* ``capture 1 head``: with an observer of head 0 that keeps the event's weights;
* ``capture all heads``: with an observer of every head;
* ``all heads, math path``: the same observer with ``backend="math"``, the
  explicit softmax over every weight that observers used to force.

The captured contenders keep the fused kernel for the output and rebuild
the weights they ask for from its log-sum-exp (``functional.lse_backend``).
An observer is what ``tools.capture`` registers; capture then stores the
weights as float32 on the CPU, which for float32 CPU weights copies nothing
(on a GPU it would add a device-to-host copy, so the steps keep the weights
where they are). Before timing, ``tools.capture`` of each contender is
checked against the plain output and the math path's weights.

Peak memory is measured in a fresh subprocess per contender, as in
``dcmha_memory``: the process builds the layer and input, runs one warm-up
forward of that contender, records VmRSS, resets VmHWM (writing "5" to
/proc/self/clear_refs), runs the contender once and reads VmHWM (the peak
resident set, /proc/self/status); the figure is the peak minus the resident
set before, in MiB: the kernel's work memory plus the weights it keeps.
tracemalloc would not see torch's allocations. Each scenario prints its
memory line to stderr, and::

    .venv/bin/python -m benchmarks.cases.capture_overhead [T ...]

prints a markdown table (default T = 1024).

On a GPU (``--set device=cuda``, with ``--set dtype=bfloat16`` for the
flash kernel) the steps synchronise the device and the memory line gives,
per contender, ``torch.cuda.max_memory_allocated`` during one forward minus
the memory allocated before it (torch's caching allocator counts every
tensor it hands out).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import torch

from ..registry import register

CONTENDERS = ("uncaptured", "capture 1 head", "capture all heads", "all heads, math path")

_PROBE = r"""
import sys, torch
from multihead import MultiHeadAttention
T, which = int(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
torch.manual_seed(0)
m = MultiHeadAttention(768, 12).eval()
x = torch.randn(1, T, 768)
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])  # kB
def run():
    if which == "uncaptured":
        return m(x, is_causal=True)
    kept = []
    handle = m.register_attention_observer(lambda mod, e: kept.append(e.weights),
                                           heads=[0] if which == "capture 1 head" else None)
    m(x, is_causal=True, backend="math" if which == "all heads, math path" else "auto")
    handle.remove()
    return kept
with torch.no_grad():
    kept = run()  # warm up allocator and kernels
    del kept
    rss = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    kept = run()
    peak = status("VmHWM:")
print((peak - rss) / 1024)
"""


def peak_forward_mib(T: int, contender: str) -> float:
    """Peak extra resident memory (MiB) of one forward of ``contender``, in a fresh process."""
    res = subprocess.run(
        [sys.executable, "-c", _PROBE, str(T), contender], capture_output=True, text=True, check=True
    )
    return float(res.stdout.strip().splitlines()[-1])


@register(
    "capture_overhead",
    description=(
        "GPT-2-small attention layer (768, 12 heads, B=1, causal, float32, CPU, eval, no_grad): the plain "
        "forward vs the same forward observed (what tools.capture registers) for 1 head and for all heads "
        "(fused kernel plus weights rebuilt from its log-sum-exp) and for all heads on the explicit math path; "
        "peak memory of each is printed."
    ),
    config={"embed_dim": 768, "num_heads": 12, "batch": 1, "seq": 1024, "seed": 0, "memory": True,
            "device": "cpu", "dtype": "float32",
            "warmup": 2, "rounds": 10, "number": 1},  # fmt: skip
    quick={"seq": 128, "memory": False, "warmup": 1, "rounds": 3},
    scenarios={"T=1024 (128 with --quick)": {}},
    baseline="uncaptured",
)
def setup(config: dict[str, Any]) -> dict[str, Any]:
    from multihead import MultiHeadAttention
    from multihead.tools import capture

    C, H, B, T = (int(config[k]) for k in ("embed_dim", "num_heads", "batch", "seq"))
    device, dtype = torch.device(config["device"]), getattr(torch, config["dtype"])
    torch.manual_seed(int(config["seed"]))
    m = MultiHeadAttention(C, H, device=device, dtype=dtype).eval()
    x = torch.randn(B, T, C, device=device, dtype=dtype)
    cuda = device.type == "cuda"

    def forward(heads, backend):
        with capture(m, heads=heads) as record:
            out = m(x, is_causal=True, backend=backend)
        return out, record.layers[0].weights

    with torch.no_grad():  # the contenders compute the same output and the same weights
        plain = m(x, is_causal=True)
        out_one, one = forward([0], "auto")
        out_all, every = forward(None, "auto")
        out_math, want = forward(None, "math")
    tol = {} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}  # half: two roundings of the output
    for out in (out_one, out_all, out_math):
        torch.testing.assert_close(out, plain, msg="capture_overhead: a captured output differs", **tol)
    torch.testing.assert_close(every, want, msg="capture_overhead: weights differ from the math path", **tol)
    torch.testing.assert_close(one, want[:, :1], msg="capture_overhead: one head's weights differ", **tol)

    def step(heads, backend, captured=True):
        def run() -> None:
            kept = []
            with torch.no_grad():
                if captured:
                    handle = m.register_attention_observer(lambda mod, e: kept.append(e.weights), heads=heads)
                    m(x, is_causal=True, backend=backend)
                    handle.remove()
                else:
                    m(x, is_causal=True)
            if cuda:
                torch.cuda.synchronize()

        return run

    steps = {
        "uncaptured": step(None, "auto", captured=False),
        "capture 1 head": step([0], "auto"),
        "capture all heads": step(None, "auto"),
        "all heads, math path": step(None, "math"),
    }
    if config["memory"]:
        peak = (lambda c: cuda_peak_mib(steps[c])) if cuda else (lambda c: peak_forward_mib(T, c))
        peaks = ", ".join(f"{c} {peak(c):.0f} MiB" for c in CONTENDERS)
        print(f"capture_overhead T={T} on {device.type}: peak forward memory {peaks}", file=sys.stderr)
    return steps


def cuda_peak_mib(run) -> float:
    """Peak extra CUDA memory (MiB) torch allocates during ``run()`` (after a warm-up call)."""
    run()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv] or [1024]
    print("| T | " + " | ".join(f"{c} peak (MiB)" for c in CONTENDERS) + " |")
    print("|---|" + "---|" * len(CONTENDERS))
    for T in sizes:
        print(f"| {T} | " + " | ".join(f"{peak_forward_mib(T, c):.0f}" for c in CONTENDERS) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
