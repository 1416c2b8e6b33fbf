"""Where the time of a captured forward goes, step by step.

    python -m benchmarks.capture_steps [--seq 1024] [--threads 1] [--rounds 10]
                                       [--before OTHER/src]

At the ``capture_overhead`` case's sizes (one ``MultiHeadAttention(768, 12)``,
B = 1, causal, float32, CPU, eval, ``no_grad``), times in alternating rounds
(``timing.time_alternating``):

* ``forward``: the plain layer forward;
* ``captured``: the same forward with an observer of every head (what
  ``tools.capture`` registers), the contender of the case;
* ``kernel``: the fused CPU kernel alone on the layer's q, k, v (output and
  log-sum-exp; the projections are the rest of ``forward``);
* ``rebuild``: ``functional.weights.rebuild_weights`` alone, all heads, from
  that log-sum-exp, into fresh memory as in a capture; with ``--before``,
  ``rebuild (before)`` is the same function loaded from another source tree's
  ``multihead/functional/weights.py`` (it imports torch only), so two
  versions are compared in one process;
* ``touch fresh [B, H, T, S]``: ``torch.empty`` of the weights' size, filled
  with zeros: what writing that much memory fresh from the system costs
  (its page faults);
* ``fill touched [B, H, T, S]``: the same fill into memory allocated once
  and already written (memory bandwidth only).

Then it prints the minor page faults of one call of ``forward`` and of
``captured`` (``resource.getrusage``), the median times, and each step's
ratio to ``forward`` (per-round median). A diagnostic beside
``benchmarks.run capture_overhead``, which gives the figures to quote.
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import statistics
import sys
from pathlib import Path

import torch

from multihead import MultiHeadAttention
from multihead.functional.weights import rebuild_weights

from .run import load_average
from .timing import threads, time_alternating


def _rebuild_from(src: str):
    """``rebuild_weights`` of the tree whose package root is ``src`` (…/src)."""
    path = Path(src) / "multihead" / "functional" / "weights.py"
    spec = importlib.util.spec_from_file_location("_weights_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.rebuild_weights


def _faults(step) -> int:
    """Minor page faults of one call of ``step``."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def steps(T: int, before: str | None) -> dict:
    """The steps to time, at B = 1, C = 768, H = 12, causal."""
    torch.manual_seed(0)
    m = MultiHeadAttention(768, 12).eval()
    x = torch.randn(1, T, 768)
    seen = []
    handle = m.register_attention_observer(lambda mod, e: seen.append(e))
    m(x, is_causal=True)
    handle.remove()
    e = seen.pop()
    q, k, v = e.q, e.k, e.v  # (1, 12, T, 64) each
    kernel_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    _, lse = kernel_op(q, k, v, 0.0, True, scale=e.scale)
    shape = e.weights.shape  # (1, 12, T, T)
    touched = torch.zeros(shape)

    def captured():
        kept = []
        h = m.register_attention_observer(lambda mod, ev: kept.append(ev.weights))
        m(x, is_causal=True)
        h.remove()

    def rebuild(fn):
        return lambda: fn(q, k, lse, scale=e.scale, bias=None, visible=None, heads=None, rows=None, causal_offset=0)

    out = {
        "forward": lambda: m(x, is_causal=True),
        "captured": captured,
        "kernel": lambda: kernel_op(q, k, v, 0.0, True, scale=e.scale),
        "rebuild": rebuild(rebuild_weights),
    }
    if before:
        old = _rebuild_from(before)
        torch.testing.assert_close(old(q, k, lse, scale=e.scale, bias=None, visible=None, heads=None, rows=None,
                                       causal_offset=0), e.weights)  # fmt: skip
        out["rebuild (before)"] = rebuild(old)
    torch.testing.assert_close(out["rebuild"](), e.weights)
    out[f"touch fresh {list(shape)}"] = lambda: torch.empty(shape).fill_(0.0)
    out[f"fill touched {list(shape)}"] = lambda: touched.fill_(0.0)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--before", default=None, help="another tree's src folder: its rebuild_weights is timed too")
    args = p.parse_args(argv)
    with threads(args.threads), torch.no_grad():
        todo = steps(args.seq, args.before)
        for step in todo.values():
            step()
        faults = {name: _faults(todo[name]) for name in ("forward", "captured")}
        load = load_average()
        times = time_alternating(todo, warmup=args.warmup, rounds=args.rounds)
    base = times["forward"]
    print(f"T={args.seq}, torch threads {args.threads or torch.get_num_threads()}, load average before {load}, "
          f"after {load_average()}; minor page faults per call: forward {faults['forward']}, "
          f"captured {faults['captured']}")  # fmt: skip
    print("| step | median ms | / forward (per-round median) |")
    print("|---|---|---|")
    for name, xs in times.items():
        ratio = statistics.median(a / b for a, b in zip(xs, base))
        print(f"| {name} | {statistics.median(xs) * 1e3:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
