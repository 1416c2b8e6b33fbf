"""Multi-head Latent Attention in NumPy float64: the specification.

DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model" (arXiv:2405.04434, 2024), section 2.1,
with the RMS norms of the latents and the YaRN rope of DeepSeek-V3's code.
Per query token t, key token j and head i (h the layer inputs)::

    c^Q_t  = RMSNorm(h_t W^DQ) ⊙ g^Q             (q_lora_rank; without it c^Q_t = h_t)
    q^C_ti = c^Q_t W^UQ_i                         (Dn)     q^R_ti = RoPE(c^Q_t W^QR_i)   (R)
    c^KV_j = RMSNorm(h_j W^DKV) ⊙ g^KV            (L, the cached latent; h_j W^DKV without kv_norm)
    k^C_ji = c^KV_j W^UK_i                        (Dn)     k^R_j = RoPE(h_j W^KR)      (R, shared by all heads)
    v^C_ji = c^KV_j W^UV_i                        (Dv)
    s_tji  = scale · (q^C_ti · k^C_ji + q^R_ti · k^R_j),   scale = 1/sqrt(Dn + R) (· m² with YaRN)
    o_ti   = Σ_j softmax_j(s_ti·) v^C_ji
    u_t    = [o_t1, ..., o_tH] W^O

RoPE rotates the first r channels of the R rope channels in pairs (2k, 2k+1)
(interleaved, DeepSeek's) or (k, k + r/2) by position · θ_k, θ_k =
base^(-2k/r), or YaRN's θ'_k (:func:`yarn_theta`). ``qk_norm`` gains, when
given, RMS-normalise q^R_ti and k^R_j before the rotation.

R may be 0 (no rope part: s_tji = scale · q^C_ti · k^C_ji, scale = 1/sqrt(Dn)).

Weights are in the paper's (in, out) layout, ``x @ W``, split per head:
W^UQ_i is ``W_UQ[:, i]`` of shape [.., H, Dn].
"""

import math

import numpy as np

from multihead.reference.attention import _check_mask, causal_mask

__all__ = ["mla_attention", "yarn_theta", "rope_rotate"]


def yarn_theta(r, base, factor, original_seq_len, beta_fast=32.0, beta_slow=1.0):
    """YaRN frequencies θ'_k [r/2]: θ_k / factor below channel ``low``,
    θ_k above ``high``, a linear ramp between; the correction range is
    d(n) = r · ln(L0 / (2π n)) / (2 ln base), low = max(floor(d(beta_fast)), 0),
    high = min(ceil(d(beta_slow)), r - 1)."""
    theta = base ** (-np.arange(0, r, 2, dtype=np.float64) / r)
    d = [r * math.log(original_seq_len / (n * 2 * math.pi)) / (2 * math.log(base)) for n in (beta_fast, beta_slow)]
    low, high = max(math.floor(d[0]), 0), min(math.ceil(d[1]), r - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(r // 2) - low) / (high - low), 0.0, 1.0)
    return theta / factor * ramp + theta * (1.0 - ramp)


def rope_rotate(x, pos, theta, interleaved=True):
    """x [B, N, L, R], pos [L] or [B, L], theta [r/2]: rotate the first r = 2·len(theta)
    channels pair by pair by pos·θ_k (pairs (2k, 2k+1) or (k, k + r/2))."""
    B, _, L, _ = x.shape
    r = 2 * len(theta)
    ang = np.broadcast_to(np.asarray(pos, dtype=np.float64), (B, L))[:, None, :, None] * theta  # (B, 1, L, r/2)
    ia = np.arange(0, r, 2) if interleaved else np.arange(r // 2)
    ib = ia + 1 if interleaved else ia + r // 2
    out = np.array(x, dtype=np.float64)
    a, b = x[..., ia], x[..., ib]
    out[..., ia] = a * np.cos(ang) - b * np.sin(ang)
    out[..., ib] = b * np.cos(ang) + a * np.sin(ang)
    return out


def _rms(x, gain, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * gain


def _lin(x, w, W, b):
    y = x @ np.asarray(w[W], dtype=np.float64)
    return y if w.get(b) is None else y + np.asarray(w[b], dtype=np.float64)


def mla_attention(
    h_q,
    h_kv,
    w,
    *,
    q_pos=None,
    k_pos=None,
    rope=None,
    yarn=None,
    qk_norm=None,
    eps=1e-6,
    norm_eps=1e-6,
    kv_norm=True,
    mask=None,
    is_causal=False,
    causal_alignment="top_left",
    return_weights=False,
):
    """MLA of the module docstring, head by head and query by query.

    Args:
        h_q: [B, T, C] query-side inputs; h_kv: [B, S, Ck] (h_q for self-attention).
        w: dict of weights: ``W_UQ`` [Cq, H, Dn], ``W_QR`` [Cq, H, R] with Cq
            = C, or with ``W_DQ`` [C, Rq] and ``g_Q`` [Rq] Cq = Rq;
            ``W_DKV`` [Ck, L], ``g_KV`` [L] (with ``kv_norm``), ``W_KR`` [Ck, R], ``W_UK``
            [L, H, Dn], ``W_UV`` [L, H, Dv], ``W_O`` [H·Dv, C_out]; optional
            biases ``b_DQ``, ``b_UQ``, ``b_QR``, ``b_DKV``, ``b_KR``, ``b_O``.
        q_pos, k_pos: rope positions [T] / [S] or [B, ·] (default 0 .. T-1 / 0 .. S-1).
        rope: None (no rotation) or a dict ``base``, ``interleaved``, ``rotary_dim``.
        yarn: None or a dict ``factor``, ``original_seq_len``, ``beta_fast``,
            ``beta_slow``, ``mscale``: YaRN frequencies and the scale · m²,
            m = 0.1 · mscale · ln(factor) + 1.
        qk_norm: None or (gain of q^R [R], gain of k^R [R]) with ``eps``.
        norm_eps: eps of the latent norms.
        kv_norm: False: c^KV_j = h_j W^DKV (+ b_DKV), no RMS norm and no gain.
        mask, is_causal, causal_alignment: as :func:`multihead.reference.attention`
            (hidden keys removed; a query seeing nothing gets output 0).
        return_weights: also return the weights [B, H, T, S].

    Returns:
        u [B, T, C_out], or (u, weights).
    """
    h_q, h_kv = np.asarray(h_q, dtype=np.float64), np.asarray(h_kv, dtype=np.float64)
    B, T, _ = h_q.shape
    S = h_kv.shape[1]
    c_q = h_q if w.get("W_DQ") is None else _rms(_lin(h_q, w, "W_DQ", "b_DQ"), w["g_Q"], norm_eps)
    q_C = np.einsum("btc,chd->bhtd", c_q, w["W_UQ"]) + (0 if w.get("b_UQ") is None else w["b_UQ"][:, None])
    q_R = np.einsum("btc,chd->bhtd", c_q, w["W_QR"]) + (0 if w.get("b_QR") is None else w["b_QR"][:, None])
    c_kv = _lin(h_kv, w, "W_DKV", "b_DKV")  # (B, S, L)
    c_kv = _rms(c_kv, w["g_KV"], norm_eps) if kv_norm else c_kv
    k_R = _lin(h_kv, w, "W_KR", "b_KR")[:, None]  # (B, 1, S, R)
    k_C = np.einsum("bsl,lhd->bhsd", c_kv, w["W_UK"])  # (B, H, S, Dn)
    v_C = np.einsum("bsl,lhd->bhsd", c_kv, w["W_UV"])  # (B, H, S, Dv)
    H, Dn, R = q_C.shape[1], q_C.shape[-1], q_R.shape[-1]
    if qk_norm is not None:
        q_R, k_R = _rms(q_R, qk_norm[0], eps), _rms(k_R, qk_norm[1], eps)
    scale = 1.0 / math.sqrt(Dn + R)
    if rope is not None:
        r = R if rope.get("rotary_dim") is None else rope["rotary_dim"]
        base = rope.get("base", 10000.0)
        if yarn is None:
            theta = base ** (-np.arange(0, r, 2, dtype=np.float64) / r)
        else:
            theta = yarn_theta(r, base, yarn["factor"], yarn["original_seq_len"], yarn.get("beta_fast", 32.0),
                               yarn.get("beta_slow", 1.0))  # fmt: skip
            scale *= (0.1 * yarn.get("mscale", 1.0) * math.log(yarn["factor"]) + 1.0) ** 2
        interleaved = rope.get("interleaved", True)
        q_R = rope_rotate(q_R, np.arange(T) if q_pos is None else q_pos, theta, interleaved)
        k_R = rope_rotate(k_R, np.arange(S) if k_pos is None else k_pos, theta, interleaved)

    allowed = np.ones((B, H, T, S), dtype=bool)
    bias = np.zeros((B, H, T, S))
    if mask is not None:
        mask = _check_mask(mask, B, H, T, S)
        if mask.dtype == np.bool_:
            allowed &= mask
        else:
            allowed &= ~np.isneginf(mask)
            bias = np.where(allowed, np.broadcast_to(mask, (B, H, T, S)), 0.0)
    if is_causal:
        allowed &= causal_mask(T, S, causal_alignment)
    P = np.zeros((B, H, T, S))
    O = np.zeros((B, H, T, v_C.shape[-1]))
    for b in range(B):
        for i in range(H):
            for t in range(T):
                keep = allowed[b, i, t]
                if not keep.any():
                    continue
                s = scale * (k_C[b, i] @ q_C[b, i, t] + k_R[b, 0] @ q_R[b, i, t]) + bias[b, i, t]  # (S,)
                e = np.exp(s[keep] - s[keep].max())
                P[b, i, t, keep] = e / e.sum()
                O[b, i, t] = P[b, i, t, keep] @ v_C[b, i, keep]
    u = _lin(O.transpose(0, 2, 1, 3).reshape(B, T, -1), w, "W_O", "b_O")  # (B, H, T, Dv) -> (B, T, H*Dv)
    return (u, P) if return_weights else u
