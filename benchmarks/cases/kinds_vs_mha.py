"""Every registered attention kind against MHA at equal width.

Each kind of ``multihead.list_attention_kinds()`` is built with
``build_attention(kind, embed_dim=768, num_heads=12)`` (``gqa`` with 4
key/value heads; every other kind with its defaults), causal
self-attention on the same input, B=2, T=512, float32, CPU. Scenarios:
forward (eval, ``no_grad``) and forward+backward (train mode, the kind's
``aux_loss()`` added to the loss, gradients cleared first). Ratios are
kind / mha (above 1: the kind is slower than plain multi-head attention).

The kinds compute different functions, so nothing is compared across
them; setup checks that each output has shape (B, T, C) and is finite. Each
contender's FLOPs are its own ``cost()`` (x3 with backward), so the report
also gives each kind's FLOP/s. A kind added to the registry joins the
table without changes here (its options go in ``kind_options`` if its
defaults cannot be built at this width).
"""

from __future__ import annotations

from typing import Any

import torch

from ..registry import Contenders, register
from .attention_peers import dtype_of


def setup_kinds(config: dict[str, Any]) -> Contenders:
    from multihead.modules.registry import build_attention, list_attention_kinds

    B, T, C, H = (int(config[k]) for k in ("batch", "seq", "embed_dim", "num_heads"))
    device, dtype = str(config.get("device", "cpu")), dtype_of(config["dtype"])
    train = config["mode"] == "train"
    kinds = list(config.get("kinds") or list_attention_kinds())
    kinds.sort(key=lambda k: k != "mha")  # the baseline first
    gen = torch.Generator().manual_seed(int(config["seed"]) + 1)
    x = torch.randn(B, T, C, generator=gen).to(device, dtype)
    grad_out = torch.randn(B, T, C, generator=gen).to(device, dtype)
    out = Contenders()
    for kind in kinds:
        options = dict(config["kind_options"].get(kind, {}))
        torch.manual_seed(int(config["seed"]))
        try:
            m = build_attention(kind, embed_dim=C, num_heads=H, device=device, dtype=dtype, **options)
        except (TypeError, ValueError) as e:
            out.not_timed[kind] = ("n/a", f"cannot be built at embed_dim={C}, num_heads={H}, {options}: {e}")
            continue
        m.train(train)
        inp = x.clone().requires_grad_(train)

        def step(m=m, inp=inp) -> None:
            if not train:
                with torch.no_grad():
                    m(inp, is_causal=True)
                return
            inp.grad = None
            for p in m.parameters():
                p.grad = None
            y = m(inp, is_causal=True)
            ((y * grad_out).sum() + m.aux_loss()).backward()

        with torch.no_grad():
            y = m(x, is_causal=True)
        if y.shape != (B, T, C) or not bool(torch.isfinite(y).all()):
            out.not_timed[kind] = ("refused", f"output of shape {tuple(y.shape)}, finite: {bool(torch.isfinite(y).all())}")
            continue
        out[kind] = step
        out.flops[kind] = m.cost(T, batch=B, causal=True).total_flops * (3 if train else 1)
    return out


@register(
    "kinds_vs_mha",
    description=(
        "every registered attention kind vs MHA at equal width (embed 768, 12 heads, B=2, T=512, causal, "
        "float32): forward and forward+backward; ratios kind / mha."
    ),
    config={
        "embed_dim": 768, "num_heads": 12, "batch": 2, "seq": 512, "dtype": "float32", "device": "cpu", "seed": 0,
        "mode": "forward", "kinds": None, "kind_options": {"gqa": {"num_kv_heads": 4}}, "peak": False,
        "warmup": 2, "rounds": 10, "number": 1,
    },  # fmt: skip
    quick={"batch": 1, "seq": 64, "warmup": 1, "rounds": 3},
    scenarios={"forward": {"mode": "forward"}, "fwd+bwd": {"mode": "train"}},
    baseline="mha",
)
def setup(config: dict[str, Any]) -> Contenders:
    return setup_kinds(config)
