"""A ``MultiHeadLatentAttention``'s weights in the reference's notation, and its
NumPy float64 forward (``multihead.reference.mla``)."""

from __future__ import annotations

import numpy as np
import torch

from multihead.reference.mla import mla_attention


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to(torch.float64).numpy()


def reference_weights(m) -> dict:
    """The module's parameters as the reference's (in, out) per-head arrays."""
    H, L, R = m.num_heads, m.kv_lora_rank, m.qk_rope_head_dim
    Dn, Dv = m.qk_nope_head_dim, m.v_head_dim
    q = m.q_b_proj if m.q_lora_rank else m.q_proj
    Wq = _np(q.weight).T.reshape(-1, H, Dn + R)  # (Cq, H*(Dn+R)) -> (Cq, H, Dn+R)
    bq = None if q.bias is None else _np(q.bias).reshape(H, Dn + R)
    Wa, ba = _np(m.kv_a_proj.weight).T, _np(m.kv_a_proj.bias)  # (Ck, L+R)
    Wb = _np(m.kv_b_proj.weight).T.reshape(L, H, Dn + Dv)
    w = {
        "W_UQ": Wq[..., :Dn], "W_QR": Wq[..., Dn:],
        "b_UQ": None if bq is None else bq[:, :Dn], "b_QR": None if bq is None else bq[:, Dn:],
        "W_DKV": Wa[:, :L], "W_KR": Wa[:, L:], "g_KV": None if m.kv_a_norm is None else _np(m.kv_a_norm.weight),
        "b_DKV": None if ba is None else ba[:L], "b_KR": None if ba is None else ba[L:],
        "W_UK": Wb[..., :Dn], "W_UV": Wb[..., Dn:],
        "W_O": _np(m.out_proj.weight).T, "b_O": _np(m.out_proj.bias),
    }  # fmt: skip
    if m.q_lora_rank:
        w |= {"W_DQ": _np(m.q_a_proj.weight).T, "b_DQ": _np(m.q_a_proj.bias), "g_Q": _np(m.q_a_norm.weight)}
    return w


def mla_forward(m, x, kv, *, q_pos=None, k_pos=None, rope=True, norm=True, **core):
    """(out [B, T, C], weights [B, H, T, S]) of module ``m`` in NumPy float64;
    ``rope`` / ``norm`` False leave out its rope / qk_norm."""
    qk = None
    if norm and m.qk_norm is not None:
        offset = float(m.qk_norm.q_norm.unit_offset)  # gain (1 + w) with unit_offset
        qk = (offset + _np(m.qk_norm.q_norm.weight), offset + _np(m.qk_norm.k_norm.weight))
    return mla_attention(
        np.asarray(x, dtype=np.float64), np.asarray(kv, dtype=np.float64), reference_weights(m),
        q_pos=q_pos, k_pos=k_pos, rope=dict(m.rope) if rope and m.rope is not None else None,
        yarn=m.yarn if rope else None, qk_norm=qk, eps=m.qk_norm.q_norm.eps if qk else 1e-6,
        norm_eps=1e-6 if m.kv_a_norm is None else m.kv_a_norm.eps, kv_norm=m.kv_a_norm is not None,
        return_weights=True, **core,
    )  # fmt: skip
