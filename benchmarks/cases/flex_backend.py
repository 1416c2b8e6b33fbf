"""The ``flex`` backend against ``sdpa`` and ``math``: one causal self-attention call.

Sizes: B = 1, H = 8 query heads over G = 2 key/value heads, T = S = 512,
D = 64, float32 on CPU (``--set device=cuda --set dtype=bfloat16`` on a GPU),
inference under ``torch.no_grad()``. Scenarios:

* ``causal``: plain causal attention (flex with a cached causal block mask);
* ``causal + alibi``: BLOOM's slopes (sdpa adds them as a float mask, flex
  in its score function);
* ``causal + softcap``: Gemma 2's soft-capping at 50 (sdpa cannot serve it,
  so it is left out).

Contenders run ``functional.attention`` with ``backend=`` each name; flex is
compiled (once) while the case is set up, and every contender's output is
checked against the math path before timing. On a GPU the steps
synchronise the device.
"""

from __future__ import annotations

from typing import Any

import torch

from ..registry import register


@register(
    "flex_backend",
    description=(
        "functional.attention with backend flex vs sdpa vs math: B=1, H=8, G=2, T=S=512, D=64, causal, "
        "inference; plain, with ALiBi, with softcap=50 (sdpa refuses it)"
    ),
    config={"batch": 1, "num_heads": 8, "num_kv_heads": 2, "seq": 512, "head_dim": 64, "device": "cpu",
            "dtype": "float32", "warmup": 2, "rounds": 10, "number": 2},  # fmt: skip
    quick={"seq": 128, "rounds": 3, "number": 1},
    scenarios={"causal": {"mods": "none"}, "causal + alibi": {"mods": "alibi"}, "causal + softcap": {"mods": "softcap"}},
    baseline="math",
)
def setup(config: dict[str, Any]) -> dict[str, Any]:
    from multihead.functional import alibi_slopes, attention

    B, H, G, T, D = (int(config[k]) for k in ("batch", "num_heads", "num_kv_heads", "seq", "head_dim"))
    device, dtype = torch.device(config["device"]), getattr(torch, config["dtype"])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g).to(device, dtype)
    k = torch.randn(B, G, T, D, generator=g).to(device, dtype)
    v = torch.randn(B, G, T, D, generator=g).to(device, dtype)
    call: dict[str, Any] = {"is_causal": True}
    if config["mods"] == "alibi":
        call["alibi_slopes"] = alibi_slopes(H, device=device)
    elif config["mods"] == "softcap":
        call["softcap"] = 50.0
    names = ["flex", "math"] if "softcap" in call else ["flex", "sdpa", "math"]
    cuda = device.type == "cuda"

    def step(name: str):
        def run() -> None:
            with torch.no_grad():
                attention(q, k, v, backend=name, **call)
            if cuda:
                torch.cuda.synchronize()

        return run

    with torch.no_grad():
        want = attention(q, k, v, backend="math", **call)
        tol = {} if dtype == torch.float32 else {"rtol": 0.0, "atol": 3e-2}
        for name in names:
            torch.testing.assert_close(attention(q, k, v, backend=name, **call), want,
                                       msg=f"flex_backend: {name} differs from math", **tol)  # fmt: skip
    return {name: step(name) for name in names}
