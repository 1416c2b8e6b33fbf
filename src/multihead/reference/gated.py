"""Hard-concrete head gates (Voita et al. 2019) in NumPy float64: the specification.

Voita, Talbot, Moiseev, Sennrich, Titov, "Analyzing Multi-Head Self-Attention:
Specialized Heads Do the Heavy Lifting, the Rest Can Be Pruned" (ACL 2019,
arXiv:1905.09418; code ``lena-voita/the-story-of-heads``,
``lib/layers/concrete_gate.py`` and ``lib/layers/attn.py``). Each head's output
is multiplied by a scalar gate g_h in [0, 1] before the output projection::

    head_h = softmax(Q_h K_h^T / sqrt(d) + mask) V_h          (n_q, d)
    out    = concat(g_1 head_1, ..., g_H head_H) W_O^T + b_O

The gate follows the stretched hard-concrete distribution of Louizos, Welling
and Kingma (arXiv:1712.01312), with log-parameter log_a_h, temperature T and
stretch limits (low, high) = (-0.1, 1.1)::

    training:  u ~ U(eps, 1 - eps)
               s = sigmoid((ln u - ln(1 - u) + log_a) / T)
               g = clip(s (high - low) + low, 0, 1)
    eval:      g = clip(sigmoid(log_a) (high - low) + low, 0, 1)

and the L0 penalty is the expected number of non-zero gates::

    p_open_h = clip(sigmoid(log_a_h - T ln(-low / high)), eps, 1 - eps)
    L0       = coef * sum_h p_open_h

Everything here is float64 and written for reading, not speed.
"""

import math

import numpy as np

from multihead.reference.attention import attention

TEMPERATURE = 0.33
LIMITS = (-0.1, 1.1)
EPS = 1e-6


def _sigmoid(x):
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # exact, overflow-free logistic


def hard_concrete_sample(log_alpha, u, temperature=TEMPERATURE, limits=LIMITS):
    """Training-time gates from uniform noise (the reparametrised sample).

    Args:
        log_alpha: [...] gate log-parameters.
        u: [...] uniform noise in (0, 1), broadcastable with ``log_alpha``.
        temperature: T > 0.
        limits: (low, high) stretch interval, low < 0 < 1 < high.

    Returns:
        g [...] in [0, 1]: clip(sigmoid((ln u - ln(1 - u) + log_a) / T)
        (high - low) + low, 0, 1).
    """
    low, high = limits
    log_alpha, u = np.asarray(log_alpha, np.float64), np.asarray(u, np.float64)
    s = _sigmoid((np.log(u) - np.log1p(-u) + log_alpha) / temperature)
    return np.clip(s * (high - low) + low, 0.0, 1.0)


def hard_concrete_sample_grad(log_alpha, u, temperature=TEMPERATURE, limits=LIMITS):
    """d g / d log_alpha of :func:`hard_concrete_sample` (0 where clipped)."""
    low, high = limits
    log_alpha, u = np.asarray(log_alpha, np.float64), np.asarray(u, np.float64)
    s = _sigmoid((np.log(u) - np.log1p(-u) + log_alpha) / temperature)
    z = s * (high - low) + low
    return np.where((z > 0) & (z < 1), s * (1 - s) / temperature * (high - low), 0.0)


def hard_concrete_eval_gate(log_alpha, limits=LIMITS):
    """Evaluation-time gates: clip(sigmoid(log_a) (high - low) + low, 0, 1).

    No noise and no temperature (the official ``get_gates`` with
    ``is_train=False``). With the default limits g = 0 exactly when
    log_a <= ln(1/11) and g = 1 exactly when log_a >= ln 11.
    """
    low, high = limits
    return np.clip(_sigmoid(log_alpha) * (high - low) + low, 0.0, 1.0)


def hard_concrete_eval_gate_grad(log_alpha, limits=LIMITS):
    """d g / d log_alpha of :func:`hard_concrete_eval_gate` (0 where clipped)."""
    low, high = limits
    s = _sigmoid(log_alpha)
    z = s * (high - low) + low
    return np.where((z > 0) & (z < 1), s * (1 - s) * (high - low), 0.0)


def hard_concrete_cdf(x, log_alpha, temperature=TEMPERATURE, limits=LIMITS):
    """P(g <= x) for the training-time gate g (noise u ~ U(0, 1)).

    With L = ln u - ln(1 - u) standard logistic, s = sigmoid((L + log_a)/T)
    has P(s <= y) = sigmoid(T logit(y) - log_a); stretching and clipping give,
    for 0 <= x < 1, P(g <= x) = sigmoid(T logit((x - low)/(high - low)) - log_a),
    an atom P(g = 0) = sigmoid(T ln(-low/high) - log_a) at 0, and
    P(g <= x) = 1 for x >= 1 (an atom at 1). 0 for x < 0.

    Args:
        x: [...] points; log_alpha: broadcastable log-parameters.

    Returns:
        [...] probabilities.
    """
    low, high = limits
    x, log_alpha = np.broadcast_arrays(np.asarray(x, np.float64), np.asarray(log_alpha, np.float64))
    y = (np.clip(x, 0.0, 1.0) - low) / (high - low)  # in (0, 1) since low < 0 < 1 < high
    inside = _sigmoid(temperature * (np.log(y) - np.log1p(-y)) - log_alpha)
    return np.where(x < 0, 0.0, np.where(x >= 1, 1.0, inside))


def hard_concrete_mean(log_alpha, temperature=TEMPERATURE, limits=LIMITS, n=20001):
    """E[g] = integral over [0, 1) of (1 - P(g <= x)) dx (Simpson's rule, n points).

    The integrand is smooth on [0, 1]; its value at x = 1 is the left limit
    (the atom of g at 1 is not part of the integral).
    """
    low, high = limits
    x = np.linspace(0.0, 1.0, n)
    y = ((x - low) / (high - low))[:, None]  # (n, 1)
    la = np.atleast_1d(np.asarray(log_alpha, np.float64))[None, :]  # (1, H)
    tail = 1.0 - _sigmoid(temperature * (np.log(y) - np.log1p(-y)) - la)  # (n, H)
    w = np.ones(n)
    w[1:-1:2], w[2:-1:2] = 4.0, 2.0  # Simpson weights 1 4 2 4 ... 2 4 1
    mean = (w[:, None] * tail).sum(axis=0) * (x[1] - x[0]) / 3.0
    return mean.reshape(np.shape(log_alpha))


def open_probability(log_alpha, temperature=TEMPERATURE, limits=LIMITS, eps=EPS):
    """P(g_h != 0) = clip(sigmoid(log_a - T ln(-low/high)), eps, 1 - eps)."""
    low, high = limits
    return np.clip(_sigmoid(np.asarray(log_alpha, np.float64) - temperature * math.log(-low / high)), eps, 1 - eps)


def l0_penalty(log_alpha, temperature=TEMPERATURE, limits=LIMITS, eps=EPS, coef=1.0):
    """The layer's L0 penalty coef * sum_h P(g_h != 0) (``ConcreteGate.get_penalty``).

    Returns:
        (value, gradient with respect to log_alpha [H]).
    """
    p = open_probability(log_alpha, temperature, limits, eps)
    low, high = limits
    raw = _sigmoid(np.asarray(log_alpha, np.float64) - temperature * math.log(-low / high))
    grad = np.where((raw > eps) & (raw < 1 - eps), coef * raw * (1 - raw), 0.0)
    return coef * float(p.sum()), grad


def gated_multihead_attention(
    x_q,
    x_kv,
    W_q,
    W_k,
    W_v,
    W_o,
    gates,
    *,
    b_q=None,
    b_k=None,
    b_v=None,
    b_o=None,
    num_heads,
    num_kv_heads=None,
    mask=None,
    is_causal=False,
    causal_alignment="top_left",
):
    """Multi-head attention whose head outputs are scaled by gates.

    Weights use PyTorch's (out, in) layout: y = x W^T + b. Head h owns rows
    h*d .. (h+1)*d - 1 of W_q (and of W_k, W_v for its key/value group
    h // (H / G)) and columns h*d .. (h+1)*d - 1 of W_o.

    Args:
        x_q: [B, T, C] queries; x_kv: [B, S, Ck] keys/values (x_q for self-attention).
        W_q: [H*d, C]; W_k, W_v: [G*d, Ck]; W_o: [C, H*d].
        gates: [H] gate values g_h.
        b_q, b_k, b_v, b_o: biases or None.
        num_heads: H; num_kv_heads: G (default H).
        mask, is_causal, causal_alignment: as in :func:`reference.attention`.

    Returns:
        (out [B, T, C], weights [B, H, T, S]) where weights = g_h * softmax
        probabilities: the weights that mix the values into the gated head.
    """
    H = num_heads
    G = H if num_kv_heads is None else num_kv_heads
    x_q, x_kv = np.asarray(x_q, np.float64), np.asarray(x_kv, np.float64)
    gates = np.asarray(gates, np.float64)
    B, T, _ = x_q.shape
    S = x_kv.shape[1]
    d = W_q.shape[0] // H

    def linear(x, W, b):
        return x @ np.asarray(W).T + (0.0 if b is None else np.asarray(b))

    q = linear(x_q, W_q, b_q).reshape(B, T, H, d).transpose(0, 2, 1, 3)  # (B, T, H*d) -> (B, H, T, d)
    k = linear(x_kv, W_k, b_k).reshape(B, S, G, d).transpose(0, 2, 1, 3)  # (B, S, G*d) -> (B, G, S, d)
    v = linear(x_kv, W_v, b_v).reshape(B, S, G, d).transpose(0, 2, 1, 3)  # (B, S, G*d) -> (B, G, S, d)
    heads, probs = attention(
        q, k, v, mask=mask, is_causal=is_causal, causal_alignment=causal_alignment, return_weights=True
    )
    concat = np.zeros((B, T, H * d))
    weights = np.zeros_like(probs)
    for h in range(H):
        concat[:, :, h * d : (h + 1) * d] = gates[h] * heads[:, h]  # the gated head h
        weights[:, h] = gates[h] * probs[:, h]
    return linear(concat, W_o, b_o), weights
