"""GQA without expanded keys/values: how ``functional.attention`` runs it on CPU.

One decoding step (T = 1 query per head) against a long cache, G key/value
heads shared by H query heads. Contenders, all computing the same output:

* ``fold`` — what the ``sdpa`` backend does: the R = H // G query heads of a
  group are folded into the query axis, (B, H, 1, D) -> (B, G, R, D), and
  the fused kernel runs once per key/value head (K/V read once);
* ``enable_gqa`` — torch's ``scaled_dot_product_attention(enable_gqa=True)``;
* ``repeat`` — keys/values expanded with ``repeat_interleave`` to H heads
  first (the materialising approach).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..registry import register


@register(
    "gqa_decode",
    description="one GQA decoding step: folded query heads (multihead sdpa) vs enable_gqa vs repeat_interleave",
    config={"batch": 1, "num_heads": 32, "num_kv_heads": 4, "cache_len": 8192, "head_dim": 128, "rounds": 30, "warmup": 3, "number": 5},
    quick={"cache_len": 1024, "rounds": 5, "number": 2},
    scenarios={"decode step": {}},
    baseline="enable_gqa",
)
def setup(config: dict[str, Any]):
    B, H, G = int(config["batch"]), int(config["num_heads"]), int(config["num_kv_heads"])
    S, D = int(config["cache_len"]), int(config["head_dim"])
    R = H // G
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g)
    k = torch.randn(B, G, S, D, generator=g)
    v = torch.randn(B, G, S, D, generator=g)

    def fold():
        return F.scaled_dot_product_attention(q.view(B, G, R, D), k, v).view(B, H, 1, D)

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def repeat():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(R, 1), v.repeat_interleave(R, 1))

    want = gqa()
    torch.testing.assert_close(fold(), want)
    torch.testing.assert_close(repeat(), want)
    from multihead.functional import attention

    torch.testing.assert_close(attention(q, k, v, backend="sdpa"), want)
    return {"fold": lambda: fold(), "enable_gqa": lambda: gqa(), "repeat": lambda: repeat()}
