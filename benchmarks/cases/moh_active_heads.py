"""MoH attention: the sparse path (only active (token, head) pairs) vs the dense path.

``multihead.modules.kinds.moh.MoHAttention`` with the same weights run two ways,
and plain ``multihead.MultiHeadAttention`` of the same size (same
``qkv_proj``/``out_proj`` weights) as the baseline:

* ``moh sparse``: keys/values for every head; the attention core of the
  routed heads only over the query rows that chose them (gathered, one call
  for all routed heads, padded to the longest row list).
* ``moh dense``: every head on every token, then multiplied by its gate
  (what the official code does).
* ``mha``: the baseline, all H heads, no router.

Sizes: embed 768, 12 heads (D = 64), B=4, T=512 (and a sweep T = 256 ..
2048 at B·T = 2048 tokens, where the attention core outweighs the projections
as T grows), float32, self-attention, non-causal (MoH-DiT's setting) and
causal. Active fractions: 25 % (shared 1 + top-2 of 11 routed), 50 % (shared
3 + top-3 of 9) and 75 % (shared 6 + top-3 of 6). Runs on CUDA with
``--set device=cuda`` (then each step ends with a synchronize).
The "core" scenarios time only the attention core on precomputed q, k, v
and gates (``MoHAttention.mix_heads``; ``functional.attention`` over all
heads for mha), without the projections, which dominate the layer at T=512.
Forward: eval mode under ``no_grad``; fwd+bwd: train mode, dropout 0,
input requiring grad, ``backward(grad_out)`` (the load-balance loss is
computed but not back-propagated).

Before timing, sparse and dense outputs (and in fwd+bwd the input and
weight gradients) are compared with ``torch.testing.assert_close``.
"""

from __future__ import annotations

from typing import Any

import torch

import multihead
from multihead.functional import attention
from multihead.modules.kinds.moh import MoHAttention

from ..registry import register

SPLITS = {0.25: (1, 2), 0.5: (3, 3), 0.75: (6, 3)}  # active fraction -> (shared_heads, routed_heads) at H = 12


def build(config: dict[str, Any]) -> tuple[MoHAttention, multihead.MultiHeadAttention]:
    C, H = int(config["embed_dim"]), int(config["num_heads"])
    frac = float(config["active"])
    hs, hr = SPLITS[frac] if H == 12 else (round(H * frac / 2), H * frac - round(H * frac / 2))
    torch.manual_seed(int(config["seed"]))
    moh = MoHAttention(C, H, shared_heads=int(hs), routed_heads=int(hr))
    mha = multihead.MultiHeadAttention(C, H)
    with torch.no_grad():
        mha.qkv_proj.weight.copy_(moh.qkv_proj.weight)
        mha.qkv_proj.bias.copy_(moh.qkv_proj.bias)
        mha.out_proj.weight.copy_(moh.out_proj.weight)
        mha.out_proj.bias.copy_(moh.out_proj.bias)
    return moh, mha


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        a, b, atol=1e-5 * max(1.0, float(b.abs().max())), rtol=1e-4,
        msg=lambda m: f"moh_active_heads: {what} differ, refusing to time two different computations\n{m}",
    )


def _core_steps(moh: MoHAttention, x: torch.Tensor, causal: bool, *, train: bool, gen) -> dict[str, Any]:
    """Attention core only: all heads (mha) vs MoH dense vs MoH sparse on the same q, k, v, gates."""
    moh.eval()
    with torch.no_grad():
        q, k, v = moh.project(x)
        gates, chosen, _ = moh.route(x, q)
    q, k, v = (t.contiguous().requires_grad_(train) for t in (q, k, v))

    def mix(path):
        return moh.mix_heads(q, k, v, gates, chosen, is_causal=causal, path=path)[0]

    with torch.no_grad():
        _close(mix("sparse"), mix("dense"), "core outputs")
    if not train:
        def fwd(fn):
            def step() -> None:
                with torch.no_grad():
                    fn()
            return step

        return {
            "mha": fwd(lambda: attention(q, k, v, is_causal=causal)),
            "moh dense": fwd(lambda: mix("dense")),
            "moh sparse": fwd(lambda: mix("sparse")),
        }
    g_heads = torch.randn(q.shape, generator=gen).to(q.device)  # (B, H, T, D)
    g_mixed = g_heads.transpose(1, 2)  # (B, T, H, D)

    def back(fn, grad):
        def step() -> None:
            for t in (q, k, v):
                t.grad = None
            fn().backward(grad)
        return step

    steps = {
        "mha": back(lambda: attention(q, k, v, is_causal=causal), g_heads),
        "moh dense": back(lambda: mix("dense"), g_mixed),
        "moh sparse": back(lambda: mix("sparse"), g_mixed),
    }
    grads = []
    for name in ("moh dense", "moh sparse"):
        steps[name]()
        grads.append([t.grad.clone() for t in (q, k, v)])
    for i, (a, b) in enumerate(zip(*grads)):
        _close(b, a, f"core gradient {i}")
    return steps


@register(
    "moh_active_heads",
    description=(
        "MoHAttention sparse path (attention core only for the (token, head) pairs routed to) vs its dense "
        "path (all heads, then gated) vs MultiHeadAttention of the same size; embed 768, 12 heads, B=4, T=512 (and B=1, T=2048), "
        "float32, CPU; 50 % and 75 % active heads; whole layer and attention core alone; forward (eval, no_grad) "
        "and forward+backward (train)."
    ),
    config={
        "embed_dim": 768,
        "num_heads": 12,
        "batch": 4,
        "seq": 512,
        "seed": 0,
        "mode": "forward",
        "causal": False,
        "active": 0.5,
        "warmup": 2,
        "rounds": 15,
        "number": 1,
        "device": "cpu",
    },
    quick={"batch": 2, "seq": 64, "warmup": 1, "rounds": 3},
    scenarios={
        "forward, 50% active": {"active": 0.5},
        "forward, 75% active": {"active": 0.75},
        "forward causal, 50% active": {"active": 0.5, "causal": True},
        "forward, 50% active, B=1 T=2048": {"active": 0.5, "batch": 1, "seq": 2048},
        "core forward, 50% active": {"active": 0.5, "mode": "core"},
        "core forward, 75% active": {"active": 0.75, "mode": "core"},
        "core fwd+bwd, 50% active": {"active": 0.5, "mode": "core_train"},
        "core forward, 25% active": {"active": 0.25, "mode": "core"},
        "core forward causal, 50% active": {"active": 0.5, "mode": "core", "causal": True},
        "core forward causal, 50% active, B=1 T=2048": {"active": 0.5, "mode": "core", "causal": True, "batch": 1, "seq": 2048},
        **{f"forward{c}, 50% active, B={max(1, 2048 // n)} T={n}": {"active": 0.5, "causal": bool(c), "batch": max(1, 2048 // n), "seq": n}
           for n in (256, 512, 1024, 2048) for c in ("", " causal")},
        "fwd+bwd, 50% active": {"active": 0.5, "mode": "train"},
        "fwd+bwd, 75% active": {"active": 0.75, "mode": "train"},
    },
    baseline="mha",
)
def setup(config: dict[str, Any]) -> dict[str, Any]:
    B, T, C = int(config["batch"]), int(config["seq"]), int(config["embed_dim"])
    causal, mode = bool(config["causal"]), config["mode"]
    if mode not in ("forward", "train", "core", "core_train"):
        raise ValueError(f"mode must be 'forward', 'train', 'core' or 'core_train', got {mode!r}")
    device = torch.device(config["device"])
    moh, mha = (m.to(device) for m in build(config))
    gen = torch.Generator().manual_seed(int(config["seed"]) + 1)
    x = torch.randn(B, T, C, generator=gen).to(device)
    steps = _steps(moh, mha, x, causal, mode, gen)
    if device.type != "cuda":
        return steps

    def synced(step):
        def run() -> None:
            step()
            torch.cuda.synchronize(device)
        return run

    return {name: synced(step) for name, step in steps.items()}


def _steps(moh, mha, x, causal: bool, mode: str, gen) -> dict[str, Any]:
    B, T, C = x.shape
    if mode.startswith("core"):
        return _core_steps(moh, x, causal, train=mode == "core_train", gen=gen)

    if mode == "forward":
        moh.eval()
        mha.eval()
        with torch.no_grad():
            _close(moh(x, is_causal=causal, path="sparse"), moh(x, is_causal=causal, path="dense"), "outputs")

        def fwd(module, **kw):
            def step() -> None:
                with torch.no_grad():
                    module(x, is_causal=causal, **kw)
            return step

        return {"mha": fwd(mha), "moh dense": fwd(moh, path="dense"), "moh sparse": fwd(moh, path="sparse")}

    moh.train()
    mha.train()
    grad_out = torch.randn(B, T, C, generator=gen).to(x.device)
    inputs = {name: x.clone().requires_grad_(True) for name in ("mha", "moh dense", "moh sparse")}

    def train(module, name, **kw):
        inp = inputs[name]

        def step() -> None:
            inp.grad = None
            for p in module.parameters():
                p.grad = None
            module(inp, is_causal=causal, **kw).backward(grad_out)
        return step

    steps = {
        "mha": train(mha, "mha"),
        "moh dense": train(moh, "moh dense", path="dense"),
        "moh sparse": train(moh, "moh sparse", path="sparse"),
    }
    steps["moh dense"]()
    dense_grads = [inputs["moh dense"].grad] + [p.grad for p in moh.parameters()]
    steps["moh sparse"]()
    sparse_grads = [inputs["moh sparse"].grad] + [p.grad for p in moh.parameters()]
    for i, (a, b) in enumerate(zip(sparse_grads, dense_grads)):
        _close(a, b, f"gradient {i}")
    return steps
