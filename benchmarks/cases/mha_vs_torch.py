"""multihead.MultiHeadAttention vs torch.nn.MultiheadAttention (need_weights=False).

Self-attention at GPT-2-small sizes (embed 768, 12 heads, B=8, T=1024,
float32), both modules holding the same weights:

    torch  in_proj_weight / in_proj_bias  ->  ours qkv_proj.weight / .bias
    torch  out_proj                       ->  ours out_proj

Scenarios (one table row each):

* forward: eval mode under ``torch.no_grad()``. This lets torch take its
  fast path (``torch._native_multi_head_attention``), the one its users get
  at inference; ours goes through ``functional.attention`` (sdpa backend).
* fwd+bwd: train mode, dropout 0, input requiring grad; one step is
  forward + ``backward(grad_out)`` with all gradients set to None first.
* causal: torch gets ``attn_mask`` = bool causal mask (True = hidden) and
  ``is_causal=True`` (the documented combination; its slow path then drops
  the mask and calls SDPA with ``is_causal``, its fast path uses the mask);
  ours gets ``is_causal=True``.

Before timing, outputs (and in fwd+bwd the input and weight gradients) are
compared with ``torch.testing.assert_close`` in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import multihead

from ..registry import register

CONTENDERS = ("multihead", "torch")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"unknown dtype {name!r}")
    return dtype


def build(config: dict[str, Any]) -> tuple[multihead.MultiHeadAttention, nn.MultiheadAttention]:
    """Both modules with identical weights (torch's random init copied)."""
    C, H = int(config["embed_dim"]), int(config["num_heads"])
    dtype = _dtype(config["dtype"])
    torch.manual_seed(int(config["seed"]))
    ref = nn.MultiheadAttention(C, H, dropout=0.0, bias=True, batch_first=True, dtype=dtype)
    # torch initialises in_proj_bias and out_proj.bias to zero; give them
    # values so the bias paths are really compared.
    with torch.no_grad():
        ref.in_proj_bias.normal_(0, 0.02)
        ref.out_proj.bias.normal_(0, 0.02)
    ours = multihead.MultiHeadAttention(C, H, dropout=0.0, dtype=dtype)
    with torch.no_grad():
        ours.qkv_proj.weight.copy_(ref.in_proj_weight)
        ours.qkv_proj.bias.copy_(ref.in_proj_bias)
        ours.out_proj.weight.copy_(ref.out_proj.weight)
        ours.out_proj.bias.copy_(ref.out_proj.bias)
    return ours, ref


def _close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, *, atol: float | None = None
) -> None:
    """float32 ``assert_close`` (rtol 1.3e-6; atol 1e-5 unless given)."""
    torch.testing.assert_close(
        actual,
        expected,
        rtol=None if atol is None else 1.3e-6,
        atol=atol,
        msg=lambda m: f"mha_vs_torch: {what} differ, refusing to time two different computations\n{m}",
    )


@register(
    "mha_vs_torch",
    description=(
        "multihead.MultiHeadAttention vs torch.nn.MultiheadAttention(batch_first=True, "
        "need_weights=False), same weights, self-attention, CPU; forward in eval+no_grad "
        "and forward+backward in train mode (dropout 0), non-causal and causal."
    ),
    config={
        "embed_dim": 768,
        "num_heads": 12,
        "batch": 8,
        "seq": 1024,
        "dtype": "float32",
        "seed": 0,
        "mode": "forward",
        "causal": False,
        # Gradients are sums over the B*T rows whose float32 summation order
        # differs between the two (both are equally far from a float64
        # reference, about 3e-7 of the largest entry at full size): they are
        # compared with atol = grad_atol_rel * max |torch gradient|.
        "grad_atol_rel": 4e-6,
        # 2 cores: ~17 s a round for all four scenarios at load ~2 (~7 min in
        # all); 9 min 54 s with the machine 2x oversubscribed.
        "warmup": 2,
        "rounds": 20,
        "number": 1,
    },
    quick={"batch": 2, "seq": 128, "warmup": 1, "rounds": 3, "number": 1},
    scenarios={
        "forward no_grad, non-causal": {"mode": "forward", "causal": False},
        "forward no_grad, causal": {"mode": "forward", "causal": True},
        "fwd+bwd train, non-causal": {"mode": "train", "causal": False},
        "fwd+bwd train, causal": {"mode": "train", "causal": True},
    },
    baseline="torch",
)
def setup(config: dict[str, Any]) -> dict[str, Any]:
    B, T, C = int(config["batch"]), int(config["seq"]), int(config["embed_dim"])
    causal = bool(config["causal"])
    mode = config["mode"]
    if mode not in ("forward", "train"):
        raise ValueError(f"mode must be 'forward' or 'train', got {mode!r}")
    ours, ref = build(config)
    dtype = ref.in_proj_weight.dtype
    gen = torch.Generator().manual_seed(int(config["seed"]) + 1)
    x = torch.randn(B, T, C, generator=gen, dtype=dtype)
    # torch's bool attn_mask: True = NOT allowed to attend (future keys).
    mask = torch.ones(T, T, dtype=torch.bool).triu(1) if causal else None

    def run_ours(inp: torch.Tensor) -> torch.Tensor:
        return ours(inp, is_causal=causal)

    def run_torch(inp: torch.Tensor) -> torch.Tensor:
        out, _ = ref(inp, inp, inp, need_weights=False, attn_mask=mask, is_causal=causal)
        return out

    if mode == "forward":
        ours.eval()
        ref.eval()
        with torch.no_grad():
            _close(run_ours(x), run_torch(x), "forward outputs")

        def step_ours() -> None:
            with torch.no_grad():
                run_ours(x)

        def step_torch() -> None:
            with torch.no_grad():
                run_torch(x)

        return {"multihead": step_ours, "torch": step_torch}

    ours.train()
    ref.train()
    grad_out = torch.randn(B, T, C, generator=gen, dtype=dtype)
    x_ours = x.clone().requires_grad_(True)
    x_torch = x.clone().requires_grad_(True)

    def step(module: nn.Module, run, inp: torch.Tensor) -> None:
        inp.grad = None
        for p in module.parameters():
            p.grad = None
        run(inp).backward(grad_out)

    step(ours, run_ours, x_ours)
    step(ref, run_torch, x_torch)
    rel = float(config["grad_atol_rel"])
    for what, got, want in (
        ("input gradients", x_ours.grad, x_torch.grad),
        ("qkv weight gradients", ours.qkv_proj.weight.grad, ref.in_proj_weight.grad),
        ("qkv bias gradients", ours.qkv_proj.bias.grad, ref.in_proj_bias.grad),
        ("out_proj weight gradients", ours.out_proj.weight.grad, ref.out_proj.weight.grad),
        ("out_proj bias gradients", ours.out_proj.bias.grad, ref.out_proj.bias.grad),
    ):
        _close(got, want, what, atol=rel * float(want.abs().max()))
    with torch.no_grad():
        _close(run_ours(x), run_torch(x), "train-mode outputs")

    return {
        "multihead": lambda: step(ours, run_ours, x_ours),
        "torch": lambda: step(ref, run_torch, x_torch),
    }
