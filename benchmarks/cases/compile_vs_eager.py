"""``torch.compile`` (inductor, ``fullgraph=True``) vs eager mode on CPU.

Two scenarios, each the same module with the same weights and inputs run two
ways (``eager`` is the baseline):

* ``mha forward``: ``multihead.MultiHeadAttention`` (embed 512, 8 query heads,
  2 key/value heads), causal self-attention with a left-padding
  ``key_mask`` on x (B=4, T=256), eval mode under ``no_grad``.
* ``gpt decode step``: one cached decoding step of a ``GPT`` (embed 256,
  4 layers, 8 heads, vocab 256; batch 4) against a cache holding 128 prompt
  positions. Before each step every cache length is set back to 128, so the
  step always writes position 128 and attends over 129 positions. The
  compiled contender is first run at two other lengths, so what is timed is
  the graph with a symbolic cache length that serves a whole decode (see
  ``multihead.modules.kv_cache``), not one specialised to length 128.

Setup compiles first (the compile time is printed, not timed) and checks
that compiled and eager outputs agree (``torch.testing.assert_close``)
before anything is timed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import multihead
from multihead.models import GPT, GPTConfig

from ..registry import register


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        got, want, msg=lambda m: f"compile_vs_eager: {what} differ, refusing to time two different computations\n{m}"
    )


def _first_call(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    print(f"    compile + first call: {time.perf_counter() - start:.1f} s", flush=True)
    return out


def _mha_steps(config: dict[str, Any]) -> dict[str, Any]:
    B, T, C = int(config["batch"]), int(config["seq"]), int(config["embed_dim"])
    torch.manual_seed(int(config["seed"]))
    m = multihead.MultiHeadAttention(C, int(config["num_heads"]), num_kv_heads=int(config["num_kv_heads"])).eval()
    x = torch.randn(B, T, C)
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1:, : T // 8] = False  # rows 1.. are left-padded

    def forward(x, keep):
        return m(x, key_mask=keep, is_causal=True)

    compiled = torch.compile(forward, fullgraph=True)
    with torch.no_grad():
        _close(_first_call(compiled, x, keep), forward(x, keep), "MHA outputs")

    def eager_step():
        with torch.no_grad():
            forward(x, keep)

    def compiled_step():
        with torch.no_grad():
            compiled(x, keep)

    return {"eager": eager_step, "compiled": compiled_step}


def _gpt_steps(config: dict[str, Any]) -> dict[str, Any]:
    B, L = int(config["batch"]), int(config["cache_len"])
    torch.manual_seed(int(config["seed"]))
    cfg = GPTConfig(
        vocab_size=256, context_length=2 * L, embed_dim=int(config["embed_dim"]),
        num_layers=int(config["num_layers"]), num_heads=int(config["num_heads"]),
    )
    model = GPT(cfg).eval()
    prompt = torch.randint(0, 256, (B, L))
    token = torch.randint(0, 256, (B, 1))
    eager_caches, compiled_caches, warm_caches = (model.make_kv_caches(B, L + 8) for _ in range(3))
    with torch.no_grad():
        for caches in (eager_caches, compiled_caches, warm_caches):
            model(prompt, kv_caches=caches)

    def decode(token, caches):
        return model(token, kv_caches=caches)

    compiled = torch.compile(decode, fullgraph=True)

    def at(caches, length):
        for cache in caches:
            cache.length = length
        return caches

    with torch.no_grad():
        for length in (L - 2, L - 1):  # a static graph, then the symbolic-length one
            _first_call(compiled, token, at(warm_caches, length))
        got = compiled(token, at(compiled_caches, L))
        _close(got, decode(token, at(eager_caches, L)), "GPT decoding logits")

    def eager_step():
        with torch.no_grad():
            decode(token, at(eager_caches, L))

    def compiled_step():
        with torch.no_grad():
            compiled(token, at(compiled_caches, L))

    return {"eager": eager_step, "compiled": compiled_step}


@register(
    "compile_vs_eager",
    description=(
        "torch.compile (inductor, fullgraph) vs eager: MultiHeadAttention forward "
        "and one cached GPT decoding step"
    ),
    config={"seed": 0, "rounds": 20, "warmup": 3, "number": 5},
    quick={"rounds": 3, "warmup": 1, "number": 1},
    scenarios={
        "mha forward": {"setup": "mha", "batch": 4, "seq": 256, "embed_dim": 512, "num_heads": 8, "num_kv_heads": 2},
        "gpt decode step": {
            "setup": "gpt", "batch": 4, "cache_len": 128, "embed_dim": 256, "num_layers": 4, "num_heads": 8,
            "number": 20,
        },
    },
    baseline="eager",
)
def setup(config: dict[str, Any]):
    torch._dynamo.reset()
    return _mha_steps(config) if config["setup"] == "mha" else _gpt_steps(config)
