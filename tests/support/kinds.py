"""Every attention kind in one table, and its NumPy float64 forward.

``OPTIONS`` holds the options each registered kind is built with in the
kind-contract tests (``tests/modules/test_contract.py``); a kind registered
without a row here makes those tests fail (``options``), so a new kind is
covered from the day it is registered. ``numpy_forward`` computes a module's
output and mixing weights from its weights in NumPy float64: the kind's
projection, then the per-head RMS norm and the rotary embedding written out
here, then the kind's core from ``multihead.reference`` (``mla`` runs its
whole reference, ``support/mla.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from multihead import build_attention
from multihead.reference import attention as ref_attention
from multihead.reference.dcmha import dcmha_attention, talking_heads_attention
from multihead.reference.differential import diff_lambda, differential_attention, differential_v2_attention
from multihead.reference.gated import hard_concrete_eval_gate
from multihead.reference.moh import moh_learned_gates, moh_query_norm_gates
from multihead.reference.output_gated import output_gate
from multihead.reference.overlapping import overlapped_heads
from support.mla import mla_forward

F64 = torch.float64
C, H = 16, 4  # model width and query heads of every contract module (D = 4)

OPTIONS: dict[str, dict] = {
    "collaborative": {"shared_dim": 12},  # D̃ = 12: rope on the shared channels
    "dcmha": {"chunk_size": 2},  # blocks of 2 queries
    "diff": {"depth": 2},  # H = G: any head subset; d = 2
    "diff_v2": {"num_kv_heads": 2},  # pairs over G = 2 (each pair reads one key/value head)
    "gated": {"num_kv_heads": 2},
    "gqa": {"num_kv_heads": 2},
    "mha": {},
    "mla": {"q_lora_rank": 6, "kv_lora_rank": 10, "qk_nope_head_dim": 3, "qk_rope_head_dim": 4, "v_head_dim": 5},
    "moh": {"shared_heads": 2, "routed_heads": 1},  # every router gate exists; sparse path
    "mqa": {},
    "output_gated": {"num_kv_heads": 2, "gate": "elementwise"},
    "overlapping": {"overlap": 1},  # Dw = 6
    "talking_heads": {"chunk_size": 2},
}
LOSS_KINDS = {"moh", "gated"}  # kinds whose training forward has a loss term (aux_loss)
KINDS_TAKING = {"mha", "gqa", "mqa", "gated", "collaborative", "overlapping", "output_gated", "mla"}  # alibi / softcap (base core)
SOFTMAX_KINDS = {"mha", "gqa", "mqa", "collaborative", "overlapping", "output_gated", "mla"}  # weights = softmax(scale q·kᵀ)
COST_FORWARD = {"moh": {"path": "dense"}}  # forward options of the FLOP-counted call
COST_OPTIONS = {"moh": {"active_heads": H}}  # cost() options describing that call

POSITIONAL = {  # rope / qk_norm settings every kind is checked with
    "off": {},
    "both": {"rope": True, "qk_norm": True},
    "rope_dict": {"rope": {"interleaved": True, "base": 300.0, "rotary_dim": 2}},
    "qk_norm": {"qk_norm": True},
}


def options(kind: str) -> dict:
    """The table's options of ``kind``; a kind missing from the table is an error."""
    if kind not in OPTIONS:
        raise KeyError(f"attention kind {kind!r} has no row in tests/support/kinds.py OPTIONS; add its options")
    return dict(OPTIONS[kind])


def build(kind: str, seed: int = 0, dtype: torch.dtype = F64, randomize: bool = True, **extra) -> torch.nn.Module:
    """The kind with the table's options (and ``extra``), in eval mode; with
    ``randomize`` every parameter is drawn from N(0, 0.5²) and the qk_norm
    gains from U(0.5, 1.5), so a skipped bias or gain shows."""
    torch.manual_seed(seed)
    m = build_attention(kind, embed_dim=C, num_heads=H, dtype=dtype, **{**options(kind), **extra})
    if randomize:
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.startswith("qk_norm."):
                    p.uniform_(0.5, 1.5)
                else:
                    p.normal_(0.0, 0.5)
    return m.eval()


# ---------------------------------------------------------------- NumPy pieces
def np64(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to(F64).numpy()


def np_rope(x, pos, *, base=10000.0, interleaved=False, rotary_dim=None):
    """x [B, N, L, D], pos [L] or [B, L]: rotate channel pairs (i, i + r/2), or
    (2i, 2i + 1) when interleaved, by the angle pos·base^(-2i/r)."""
    B, _, L, D = x.shape
    r = D if rotary_dim is None else rotary_dim
    theta = base ** (-2.0 * np.arange(r // 2) / r)  # [r/2]
    ang = np.broadcast_to(np.asarray(pos, dtype=np.float64), (B, L))[:, None, :, None] * theta  # [B, 1, L, r/2]
    ia = np.arange(0, r, 2) if interleaved else np.arange(r // 2)
    ib = ia + 1 if interleaved else ia + r // 2
    out = x.copy()
    a, b = x[..., ia], x[..., ib]
    out[..., ia] = a * np.cos(ang) - b * np.sin(ang)
    out[..., ib] = b * np.cos(ang) + a * np.sin(ang)
    return out


def np_rms(x, gain, eps):
    """RMS norm over the last axis with a gain."""
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * gain


def _split(y, widths, heads):
    """y [B, L, sum(widths)] -> one [B, n, L, w/n] array per (width, heads n)."""
    out, start = [], 0
    for w, n in zip(widths, heads):
        part = y[..., start : start + w]
        out.append(part.reshape(*part.shape[:2], n, w // n).transpose(0, 2, 1, 3))  # (B, L, w) -> (B, n, L, w/n)
        start += w
    return out


def _linear(x, lin):
    y = x @ np64(lin.weight).T
    return y if lin.bias is None else y + np64(lin.bias)


def _rows(m, x, kv):
    """q from x and k, v from kv through ``qkv_proj``'s row blocks [q | k | v]."""
    W, b = np64(m.qkv_proj.weight), np64(m.qkv_proj.bias)
    y_q, y_kv = x @ W.T + b, kv @ W.T + b
    Hh, G, D = m.num_heads, m.num_kv_heads, m.head_dim
    q, _, _ = _split(y_q, (Hh * D, G * D, G * D), (Hh, G, G))
    _, k, v = _split(y_kv, (Hh * D, G * D, G * D), (Hh, G, G))
    return q, k, v


def numpy_forward(m, x, key=None, *, mask=None, is_causal=False, q_pos=None, k_pos=None, rope=True, norm=True):
    """Module ``m`` (its weights, eval mode) in NumPy float64.

    Args:
        x: [B, T, C] queries' input; key: [B, S, C] or None (self-attention).
        mask: bool (True = may attend) or float, [T, S] or 4-D (B|1, H|1, T, S).
        q_pos: query positions [T] / [B, T] (default 0 .. T-1); k_pos: key
            positions (default: q_pos in self-attention, 0 .. S-1 in cross).
        rope, norm: apply the module's rope / qk_norm (False: a different
            function, to show a check is sensitive to them).

    Returns:
        (out [B, T, C], weights [B, H, T, S]): the weights that mix the values.
    """
    x = np64(x)
    kv = x if key is None else np64(key)
    B, T, _ = x.shape
    S = kv.shape[1]
    q_pos = np.arange(T) if q_pos is None else np.asarray(q_pos)
    if k_pos is None:
        k_pos = q_pos if key is None else np.arange(S)

    def normed(q, k):
        if norm and m.qk_norm is not None:
            eps, offset = m.qk_norm.q_norm.eps, float(m.qk_norm.q_norm.unit_offset)  # gain (1 + w) with unit_offset
            q = np_rms(q, offset + np64(m.qk_norm.q_norm.weight), eps)
            k = np_rms(k, offset + np64(m.qk_norm.k_norm.weight), eps)
        return q, k

    def rotated(q, k):
        if rope and m.rope is not None:
            q, k = np_rope(q, q_pos, **dict(m.rope)), np_rope(k, k_pos, **dict(m.rope))
        return q, k

    def position(q, k):
        return rotated(*normed(q, k))

    core = dict(mask=mask, is_causal=is_causal)
    kind = type(m).kind
    if kind == "mla":  # its own reference, projections to output
        return mla_forward(m, x, kv, q_pos=q_pos, k_pos=k_pos, rope=rope, norm=norm, **core)
    if kind == "collaborative":
        out, w = _collaborative(m, x, kv, normed, rotated, mask, is_causal)
    elif kind == "overlapping":
        HD, ov = m.num_heads * m.head_dim, m.overlap
        W, b = np64(m.qkv_proj.weight), np64(m.qkv_proj.bias)
        q, k, v = (overlapped_heads(inp @ W[i * HD : (i + 1) * HD].T + b[i * HD : (i + 1) * HD], m.num_heads, ov)
                   for i, inp in enumerate((x, kv, kv)))  # fmt: skip
        q, k = position(q, k)
        out, w = ref_attention(q, k, v, scale=m.head_dim**-0.5, return_weights=True, **core)
    elif kind == "output_gated":
        out, w = _output_gated(m, x, kv, position, core)
    elif kind in ("dcmha", "talking_heads"):
        q, k, v = _rows(m, x, kv)
        q, k = position(q, k)
        if m.dynamic:
            out, w = dcmha_attention(x, kv, q, k, v, np64(m.dw1), np64(m.qkw), np64(m.dd),
                                     np64(m.pre_static), np64(m.post_static), **core)  # fmt: skip
        else:
            out, w = talking_heads_attention(q, k, v, np64(m.pre_static), np64(m.post_static), **core)
    elif kind in ("diff", "diff_v2"):
        out, w = _differential(m, x, kv, position, core)
    else:  # mha, gqa, mqa, gated, moh: one fused q|k|v projection
        q, k, v = _rows(m, x, kv)
        gates = None
        if kind == "moh" and m.router == "query_norm":  # routes on the projected q, before qk_norm/rope
            gates, _ = moh_query_norm_gates(q, m.shared_heads, m.routed_heads)
            gates = gates.transpose(0, 2, 1)[..., None]  # (B, T, H) -> (B, H, T, 1)
        elif kind == "moh":
            gates, _, _ = moh_learned_gates(x, *(np64(getattr(g, "weight", None)) for g in
                                                 (m.routed_gate, m.mix_gate, m.shared_gate)),
                                            m.shared_heads, m.routed_heads)  # fmt: skip
            gates = gates.transpose(0, 2, 1)[..., None]  # (B, T, H) -> (B, H, T, 1)
        elif kind == "gated":
            gates = hard_concrete_eval_gate(np64(m.log_alpha), tuple(m.stretch))[None, :, None, None]  # (1, H, 1, 1)
        q, k = position(q, k)
        out, w = ref_attention(q, k, v, return_weights=True, **core)
        if gates is not None:
            out, w = out * gates, w * gates
    merged = out.transpose(0, 2, 1, 3).reshape(B, T, -1)  # (B, H, T, Dv) -> (B, T, H*Dv)
    return _linear(merged, m.out_proj), w


def _differential(m, x, kv, position, core):
    """q_proj / k_proj / v_proj split into sub-heads, qk_norm and rope over d, then the reference."""
    Hh, G, d = m.num_heads, m.num_kv_heads, m.head_dim
    (q,) = _split(_linear(x, m.q_proj), (2 * Hh * d,), (2 * Hh,))  # (B, 2H, T, d)
    if type(m).kind == "diff":
        (k,) = _split(_linear(kv, m.k_proj), (2 * G * d,), (2 * G,))  # (B, 2G, S, d)
        (v,) = _split(_linear(kv, m.v_proj), (2 * G * d,), (G,))  # (B, G, S, 2d)
        q, k = position(q, k)
        lam = diff_lambda(*(np64(getattr(m, f"lambda_{n}")) for n in ("q1", "k1", "q2", "k2")), m.lambda_init)
        return differential_attention(q, k, v, lam, m.lambda_init, **core)
    (k,) = _split(_linear(kv, m.k_proj), (G * d,), (G,))  # (B, G, S, d)
    (v,) = _split(_linear(kv, m.v_proj), (G * d,), (G,))
    q, k = position(q, k)
    return differential_v2_attention(q, k, v, _linear(x, m.lambda_proj), **core)


def _output_gated(m, x, kv, position, core):
    """``qkv_proj`` rows [q | gate logits | k | v]: q and the gate's W_θ act on x,
    k and v on kv; the paper's G1 gate on the attention output."""
    W, b = np64(m.qkv_proj.weight), np64(m.qkv_proj.bias)
    Hh, G, D, E = m.num_heads, m.num_kv_heads, m.head_dim, m.gate_width
    widths, heads = (Hh * D, Hh * E, G * D, G * D), (Hh, Hh, G, G)
    bias = 0.0 if b is None else b
    q = _split(x @ W.T + bias, widths, heads)[0]
    k, v = _split(kv @ W.T + bias, widths, heads)[2:]
    rows = slice(Hh * D, Hh * (D + E))  # the gate rows: W_θ = W[rows].T
    q, k = position(q, k)
    out, w = ref_attention(q, k, v, return_weights=True, **core)
    return output_gate(out, x, W[rows].T, None if b is None else b[rows]), w


def _collaborative(m, x, kv, normed, rotated, mask, is_causal):
    """qk_norm on the shared Q, K; q_h = Q ⊙ m_h; rope on q_h and K; head h
    scores scale·(q_h·K + cb_h): the content bias enters the reference as a
    float mask added to the scaled scores."""
    Hh = m.num_heads
    Q, K = x @ np64(m.q_proj.weight).T, kv @ np64(m.k_proj.weight).T  # (B, T, D̃), (B, S, D̃)
    cb = kv @ np64(m.content_bias.weight).T  # (B, S, H)
    (v,) = _split(_linear(kv, m.v_proj), (Hh * m.head_dim,), (Hh,))  # (B, H, S, Dv)
    B, T, S = x.shape[0], x.shape[1], kv.shape[1]
    Q, K = normed(Q[:, None], K[:, None])  # (B, L, D̃) -> (B, 1, L, D̃)
    q, K = rotated(Q * np64(m.mixing)[None, :, None, :], K)  # (B, 1, T, D̃) -> (B, H, T, D̃)
    bias = np.broadcast_to(m.scale * cb.transpose(0, 2, 1)[:, :, None, :], (B, Hh, T, S))  # (B, S, H) -> (B, H, 1, S)
    if mask is None:
        full = bias
    else:
        mask = np.broadcast_to(mask, (B, Hh, T, S))
        full = np.where(mask, bias, -np.inf) if mask.dtype == bool else bias + mask
    return ref_attention(q, np.repeat(K, Hh, axis=1), v, mask=full, is_causal=is_causal, scale=m.scale,
                         return_weights=True)  # fmt: skip


def uncounted_flops(m, batch: int, T: int) -> int:
    """FLOPs a kind's ``cost()`` counts that ``FlopCounterMode`` does not see.

    The flop counter counts matrix products only. Every kind's ``cost()``
    counts matrix products too, except collaborative attention, which adds
    the mixing Q ⊙ m_h as B·H·T·D̃ multiplications (elementwise, no product).
    """
    if type(m).kind == "collaborative":
        return batch * m.num_heads * T * m.shared_dim
    return 0
