"""DCFormer's ``DCMHAttention`` (Caiyun-AI/DCFormer) as a multihead module.

    module = multihead.convert.from_official(
        "dcformer", state_dict, dim=512, n_head=8, use_qk_norm=True, lidx=0)
    y = module(x, freqs_cis, mask)          # the official forward's inputs

``state_dict`` holds one layer's attention parameters under the official
names (prefix ``layers.{l}.attention.`` stripped): ``wqkv.weight`` (or
``wq``/``wk``/``wv``), ``wo.weight``, ``dyn_w_proj.dw1``/``qkw``/``dd``
and/or the merged copies ``dw_m``/``qkw_m`` (preferred when they differ from
the originals, see the spec's "stale merged weights"),
``dyn_w_proj.pre_proj.w``/``post_proj.w`` (must be identities: ``use_sw``
is not supported) and ``q_norm.scale``/``k_norm.scale``.

The returned :class:`DCFormerAttention` wraps a
:class:`~multihead.modules.kinds.dcmha.DCMHA` built with the module's own options
``qk_norm=use_qk_norm`` (gains ``qk_norm.q_norm.weight`` / ``k_norm.weight``
= the official ``q_norm.scale`` / ``k_norm.scale``, eps 1e-6) and
``rope={"base": rope_base}`` (rotate-half pairs, ``functional.apply_rope``),
in the official order project -> QK-norm -> RoPE. The official RoPE writes
each rotated pair (j, j + d/2) to the interleaved channels (2j, 2j + 1) of
q and k alike, which leaves q·k, and so the layer, unchanged: no weight
permutation is needed. Without ``freqs_cis`` the wrapper runs the module's
forward (positions 0 .. T-1). An explicit ``freqs_cis`` table is applied
as given by :func:`rope_rotate_half`: the table holds cos/sin of
t·base^(-2j/d), from which t is recoverable only modulo 2π (and not at all
from a rounded bfloat16 table), so it is not turned into positions.
Differences from the official training branch, by design: no
bfloat16 cast of the probabilities, no key window of ``dim`` on global
layers (exact for every T), and rows with no visible key give 0 instead of
a uniform average.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...functional import causal_mask, sliding_window_mask
from ...modules.kinds.dcmha import DCMHA

__all__ = ["DCFormerAttention", "from_official", "rope_rotate_half"]

_WINDOW_TYPES = {"LG": [256, None], "LGLL": [256, None, 256, 256], "LGL6": [256, None] + [256] * 6}


def rope_rotate_half(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: pairs (j, j + d/2) by the angles in ``freqs_cis``.

    Args:
        x: [B, H, T, d]; freqs_cis: [T, d/2, 2] (cos, sin) as
            ``precompute_freqs_cis`` returns them for these positions.
    """
    half = x.shape[-1] // 2
    cos, sin = freqs_cis[..., 0].to(x.dtype), freqs_cis[..., 1].to(x.dtype)  # (T, d/2)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def precompute_freqs_cis(T: int, d: int, base: float, *, dtype=torch.float64) -> torch.Tensor:
    """[T, d/2, 2] cos/sin of θ_{t,j} = t · base^(−2j/d)."""
    j = torch.arange(0, d, 2, dtype=torch.float64)[: d // 2]
    angles = torch.arange(T, dtype=torch.float64)[:, None] * base ** (-j / d)  # (T, d/2)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).to(dtype)


class DCFormerAttention(nn.Module):
    """One official DCMHAttention layer on multihead's DCMHA core.

    Args:
        attention: the DCMHA holding wqkv/wo/dw1/qkw/dd, built with
            ``rope`` (rotate-half, the official base) and, for
            ``use_qk_norm``, ``qk_norm`` (holding the official gains).
        window: W for a local layer (None: global, causal).
    """

    def __init__(self, attention: DCMHA, *, window: int | None) -> None:
        super().__init__()
        if attention.rope is None or attention.rope["interleaved"] or attention.rope["rotary_dim"] not in (
            None, attention.head_dim,
        ):
            raise ValueError("attention must apply full rotate-half rope (DCMHA(..., rope={'base': ...}))")
        self.attention, self.window = attention, window

    @property
    def rope_base(self) -> float:
        return self.attention.rope["base"]

    def forward(
        self, x: torch.Tensor, freqs_cis: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, T, dim] -> y [B, T, dim], as the official training forward.

        Args:
            x: the normalised residual stream.
            freqs_cis: [T, d/2, 2] RoPE table for positions 0..T-1 (None:
                computed from ``rope_base``).
            mask: bool, True = may attend, broadcastable to (B, 1, T, T)
                (None: causal, or the training window t − s ≤ W on a local layer).
        """
        a = self.attention
        T = x.shape[1]
        if mask is None:
            if self.window is None:
                mask = causal_mask(T, device=x.device)
            else:
                mask = sliding_window_mask(T, window=self.window + 1, device=x.device)
        if freqs_cis is None:  # the module's own qk_norm and rope at positions 0 .. T-1
            return a(x, attn_mask=mask)
        q, k, v = a.project(x)  # (B, H, T, d) each
        if a.qk_norm is not None:
            q, k = a.qk_norm(q, k)
        q, k = rope_rotate_half(q, freqs_cis), rope_rotate_half(k, freqs_cis)
        out, _ = a.attend(q, k, v, a.dynamic_weights(x, "query"), a.dynamic_weights(x, "key"), attn_mask=mask)
        return a.merge_heads(out)


def _pick(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in sd:
        raise ValueError(f"state_dict lacks {name!r}; has {sorted(sd)}")
    return sd[name]


def from_official(
    state_dict: dict[str, torch.Tensor],
    *,
    dim: int,
    n_head: int,
    n_local_heads: int | None = None,
    head_dim: int | None = None,
    use_qk_norm: bool = False,
    rope_base: float = 500000,
    window_size: int | None = 256,
    window_type: str | None = None,
    lidx: int = 0,
    use_sw: bool = False,
    **ignored: Any,
) -> DCFormerAttention:
    """Build a :class:`DCFormerAttention` from one official layer's weights.

    Args:
        state_dict: official names (see the module docstring).
        dim, n_head, n_local_heads, use_qk_norm, rope_base, window_size,
        window_type: ``DCFormerConfig`` fields; lidx: the layer index (local
            or global from ``window_type``); other config fields are ignored.

    Raises:
        ValueError: unsupported settings (n_local_heads != n_head,
            use_sw, non-identity pre/post_proj), missing or misshapen tensors.
    """
    N = n_head
    if n_local_heads not in (None, N):
        raise ValueError(f"n_local_heads={n_local_heads} != n_head={N} is not supported by the official attention")
    if use_sw:
        raise ValueError("use_sw=True is inconsistent across the official branches and not supported")
    if window_type is not None and window_type not in _WINDOW_TYPES:
        raise ValueError(f"window_type must be one of {sorted(_WINDOW_TYPES)} or None, got {window_type!r}")
    d = dim // N  # the official config always overwrites head_dim with dim // n_head
    sd = {k: v.detach() for k, v in state_dict.items()}
    if "wqkv.weight" not in sd and all(f"w{c}.weight" in sd for c in "qkv"):
        sd["wqkv.weight"] = torch.cat([sd[f"w{c}.weight"] for c in "qkv"])
    wqkv, wo = _pick(sd, "wqkv.weight"), _pick(sd, "wo.weight")
    if tuple(wqkv.shape) != (3 * dim, dim) or tuple(wo.shape) != (dim, dim):
        raise ValueError(f"wqkv.weight must be {(3 * dim, dim)} and wo.weight {(dim, dim)}, got "
                         f"{tuple(wqkv.shape)} and {tuple(wo.shape)}")  # fmt: skip
    K, R = 4 * N, N // (N // 2) if N >= 2 else 0
    if R != 2:
        raise ValueError(f"the official code works only with rank 2 (n_head even or >= 5); got n_head={N}")
    dw1 = sd.get("dyn_w_proj.dw1")
    dd = sd.get("dyn_w_proj.dd")
    qkw = sd.get("dyn_w_proj.qkw")
    if "dyn_w_proj.dw_m" in sd:  # the merged copies win when they differ (stale originals)
        dw_m = sd["dyn_w_proj.dw_m"]
        m_dw1, m_dd = dw_m[:, : 4 * K].reshape(dim, 1, 4, K), dw_m[:, 4 * K :].reshape(dim, 1, 4 * N)
        dw1 = m_dw1 if dw1 is None or not torch.equal(dw1, m_dw1) else dw1
        dd = m_dd if dd is None or not torch.equal(dd, m_dd) else dd
    if "dyn_w_proj.qkw_m" in sd:
        m_qkw = sd["dyn_w_proj.qkw_m"].reshape(1, 4, K, 2 * R, N)
        qkw = m_qkw if qkw is None or not torch.equal(qkw, m_qkw) else qkw
    for name, t, shape in (("dw1", dw1, (dim, 1, 4, K)), ("qkw", qkw, (1, 4, K, 2 * R, N)), ("dd", dd, (dim, 1, 4 * N))):
        if t is None or tuple(t.shape) != shape:
            raise ValueError(f"dyn_w_proj.{name} must be {shape}, got {None if t is None else tuple(t.shape)}")
    for name in ("dyn_w_proj.pre_proj.w", "dyn_w_proj.post_proj.w"):
        if name in sd and not torch.equal(sd[name].reshape(N, N), torch.eye(N, dtype=sd[name].dtype)):
            raise ValueError(f"{name} is not the identity: static composition (use_sw) is not supported")
    norms = {}
    if use_qk_norm:
        norms = {"q_norm": _pick(sd, "q_norm.scale"), "k_norm": _pick(sd, "k_norm.scale")}
        for name, g in norms.items():
            if tuple(g.shape) != (d,):
                raise ValueError(f"{name}.scale must be ({d},), got {tuple(g.shape)}")
    dtype = wqkv.dtype
    core = DCMHA(
        dim, N, rank=R, dynamic_hidden_dim=K, static=False, qkv_bias=False, out_bias=False,
        rope={"base": float(rope_base)}, qk_norm=bool(use_qk_norm), dtype=dtype,
    )  # fmt: skip
    with torch.no_grad():
        core.qkv_proj.weight.copy_(wqkv)
        core.out_proj.weight.copy_(wo)
        core.dw1.copy_(dw1.reshape(dim, 4, K))
        core.qkw.copy_(qkw.reshape(4, K, 2 * R, N))
        core.dd.copy_(dd.reshape(dim, 4, N))
        for name, g in norms.items():
            getattr(core.qk_norm, name).weight.copy_(g)
    pattern = [window_size, None] if window_type is None else _WINDOW_TYPES[window_type]
    window = pattern[lidx % len(pattern)]
    return DCFormerAttention(core, window=window).eval()
