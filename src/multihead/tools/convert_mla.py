"""Convert a trained model's multi-head attention into multi-head latent attention.

    to_mla(model, r, calibration=[x0, x1, ...])      "activation" (the default)
    to_mla(model, r, method="svd")                   "svd": no data

``model`` is a GPT, a BertEncoder or a SentenceEncoder (its ``encoder`` is
converted; tokenizer and pooling are kept), with "mha", "gqa" or "mqa"
layers; calibration batches take the forms of ``to_gqa``
(``convert_heads``). Every layer becomes an "mla" layer whose keys and values
of all heads come from one latent c of r channels per token::

    MHA:  k = W_k x + b_k,  v = W_v x + b_v          W = [W_k; W_v]  [2·G·D, C]
    MLA:  c = A x            [r]                      kv_a_proj  A = U_rᵀ W  [r, C]
          [k_h | v_h] = B_h c                         kv_b_proj  B = U_r     [2·G·D, r]

a joint low-rank factorisation of the stacked key and value projections
(the idea of TransMLA, arXiv:2502.07864, and MHA2MLA, arXiv:2502.14837), with
U_r [2·G·D, r] orthonormal:

* "svd": U_r = the top r left singular vectors of W. B·A is the best
  rank-r approximation of W in Frobenius norm, every input direction
  weighing the same.
* "activation": U_r = the top r left singular vectors of W·Σ^½, Σ the
  covariance [C, C] of the layer's inputs x at the real (unpadded)
  calibration tokens (plus 1e-9·tr(Σ)/C·I, so that directions the
  calibration never reached keep a weight). B·A then minimises the mean
  squared error of the keys and values over that data, E|(W − B·A)(x − μ)|²:
  the error is measured where the inputs lie, not uniformly.

Biases and constant offsets are carried exactly, without a bias on the
up-projection: a constant added to every key of a head adds the same
amount q·const to all of a query's scores, which softmax ignores, so the key
bias b_k is dropped; a constant d_v added to every value moves each head's
output by exactly d_v (its weights sum to 1), so d_v = b_v + (W_v − B_v·A)·μ
(μ the calibration mean; 0 for "svd") is folded into ``out_proj``'s bias
(b_o += Σ_h W_o,h d_v,h). Queries and ``out_proj``'s weight are copied. The
"mla" layers take ``kv_norm=False`` (the latent is not normalised) and
``qk_rope_head_dim=0`` (no rope part: the source has absolute positions),
Dn = Dv = D, so scale = 1/√D as before. At r = rank(W), at most
min(2·G·D, C) (C = 384 for MiniLM), the converted model computes the
original's function up to rounding; the folding is exact in eval mode (dropout on the weights
breaks the sum to 1), and a query row that sees no key at all outputs
W_o·d_v where the source outputs 0 (no such row in a causal or padded model).

A query head h reads the latent through its own rows of B (those of its
key/value head h // (H / G)), so GQA and MQA layers convert too; the latent
then holds G·D key and G·D value channels at most. Layers with rope,
qk_norm or sinks are refused: rope would have to rotate keys built from the
latent (a partial-rope conversion), qk_norm normalises keys per head, and
sink logits make the weights sum to less than 1. The cache per token and
layer is r elements on the absorbed path (``decode``, the default) and
H·2·D on the naive one (``cost()`` of the kind).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn

from ..modules.kinds.mha import MultiHeadAttention
from .calibration import backbone_of, check_kind, finished, rebuilt, run_calibration

__all__ = ["to_mla", "MLA_METHODS", "check_kv_rank"]

MLA_METHODS = ("svd", "activation")
_RIDGE = 1e-9  # Σ + _RIDGE · tr(Σ)/C · I


def check_kv_rank(kv_rank: object, layers: list[nn.Module]) -> int:
    """``kv_rank`` as an int in [1, 2·G·D] of every layer (keys plus values of its key/value heads).

    Raises:
        TypeError: not an int. ValueError: out of range (the message names the widths).
    """
    if isinstance(kv_rank, bool) or not isinstance(kv_rank, int):
        raise TypeError(f"kv_rank must be an int, got kv_rank={kv_rank!r}")
    widths = [2 * layer.num_kv_heads * layer.head_dim for layer in layers]
    if kv_rank < 1 or kv_rank > min(widths):
        i = widths.index(min(widths))
        raise ValueError(
            f"kv_rank must be in [1, {min(widths)}]: the latent factors layer {i}'s keys and values "
            f"(2 x {layers[i].num_kv_heads} key/value heads x {layers[i].head_dim} channels = {min(widths)}), "
            f"got kv_rank={kv_rank}"
        )
    return kv_rank


def _check(model: nn.Module, kv_rank: int, method: str, calibration) -> list[MultiHeadAttention]:
    _, attentions = backbone_of(model, "to_mla")
    if method not in MLA_METHODS:
        raise ValueError(f"unknown method={method!r}; valid methods: {list(MLA_METHODS)}")
    for i, attn in enumerate(attentions):
        check_kind(i, attn, "to_mla")
        found = {"rope": attn.rope is not None, "qk_norm": attn.qk_norm is not None, "sinks": attn.sinks is not None}
        if any(found.values()):
            raise ValueError(
                f"layer {i} has {', '.join(n for n, v in found.items() if v)}: to_mla converts layers without rope "
                "(keys from the latent would have to be rotated), qk_norm (per-head key norms) and sinks (weights "
                "that sum to less than 1)"
            )
        if attn.kdim != attn.embed_dim or attn.vdim != attn.embed_dim:
            raise ValueError(f"layer {i} takes keys of width {attn.kdim} and values of width {attn.vdim}; "
                             f"to_mla converts self-attention layers (width {attn.embed_dim})")  # fmt: skip
    check_kv_rank(kv_rank, attentions)
    if method == "activation" and calibration is None:
        raise ValueError(
            "method='activation' (the default) needs calibration: an iterable of token batches "
            "(see to_mla); method='svd' needs none"
        )
    if method == "svd" and calibration is not None:
        raise ValueError("method='svd' takes no calibration (got one); it is used by method='activation'")
    return attentions


@torch.no_grad()
def _input_moments(model: nn.Module, layers: list[nn.Module], calibration: Iterable) -> list[tuple]:
    """Per layer (mean μ [C], covariance Σ [C, C]) of its inputs at the real calibration tokens, float64."""
    backbone, _ = backbone_of(model, "to_mla")
    sums = [[0, 0.0, 0.0] for _ in layers]  # count, Σx [C], Σxxᵀ [C, C]

    def keep(i: int):
        def hook(module, args, kwargs):
            x, mask = args[0], kwargs.get("key_mask")  # x (B, T, C), mask (B, T) bool or None
            x = (x if mask is None else x[mask.bool()]).reshape(-1, x.shape[-1]).double()  # (N, C)
            sums[i][0] += x.shape[0]
            sums[i][1] = sums[i][1] + x.sum(0)
            sums[i][2] = sums[i][2] + x.T @ x

        return hook

    run_calibration(model, backbone, layers, calibration, keep)
    out = []
    for n, s, ss in sums:
        mean = s / n
        out.append((mean, ss / n - torch.outer(mean, mean)))
    return out


def _factor(W: torch.Tensor, r: int, moments: tuple | None) -> torch.Tensor:
    """U_r [2GD, r]: orthonormal, the top r left singular vectors of W (or of W·Σ^½)."""
    if moments is not None:
        sigma = moments[1]
        C = sigma.shape[0]
        evals, evecs = torch.linalg.eigh(
            sigma + _RIDGE * sigma.trace() / C * torch.eye(C, dtype=sigma.dtype, device=sigma.device)
        )
        W = W @ (evecs * evals.clamp_min(0).sqrt()) @ evecs.T  # W Σ^½
    U, _, _ = torch.linalg.svd(W, full_matrices=True)  # (2GD, 2GD)
    U = U[:, :r]
    # each vector's sign is free: make its largest entry positive, so CPU and CUDA agree
    top = U.gather(0, U.abs().argmax(0, keepdim=True))  # (1, r)
    return U * torch.where(top < 0, -1.0, 1.0).to(U.dtype)


@torch.no_grad()
def _convert_layer(old: MultiHeadAttention, new: nn.Module, r: int, moments: tuple | None) -> None:
    """Write ``new``'s (an "mla" layer's) weights from ``old``, computed in float64."""
    H, G, D = old.num_heads, old.num_kv_heads, old.head_dim
    weights = {n: (w.double(), None if b is None else b.double()) for n, (w, b) in old.projection_weights().items()}
    (wq, bq), (wk, _), (wv, bv) = weights["q"], weights["k"], weights["v"]  # the key bias is dropped (exact)
    W = torch.cat([wk, wv])  # (2*G*D, C)
    U = _factor(W, r, moments)  # (2*G*D, r)
    A = U.T @ W  # (r, C)
    d_v = torch.zeros(G * D, dtype=W.dtype, device=W.device) if bv is None else bv.clone()  # (G*D,)
    if moments is not None:
        d_v += (W - U @ A)[G * D :] @ moments[0]  # the values' constant error at the mean input
    per_head = torch.arange(H, device=W.device) // (H // G)  # key/value head of each query head
    B_k, B_v = U[: G * D].reshape(G, D, r)[per_head], U[G * D :].reshape(G, D, r)[per_head]  # (H, D, r)
    new.q_proj.weight.copy_(wq)
    if bq is not None:
        new.q_proj.bias.copy_(bq)
    new.kv_a_proj.weight.copy_(A)
    if new.kv_a_proj.bias is not None:
        new.kv_a_proj.bias.zero_()
    new.kv_b_proj.weight.copy_(torch.cat([B_k, B_v], dim=1).reshape(H * 2 * D, r))  # head blocks [k_h | v_h]
    wo = old.out_proj.weight.double()  # (C, H*D)
    new.out_proj.weight.copy_(wo)
    bias = wo @ d_v.reshape(G, D)[per_head].reshape(H * D)  # Σ_h W_o,h d_v,h
    if old.out_proj.bias is not None:
        bias += old.out_proj.bias.double()
    new.out_proj.bias.copy_(bias)


def _new_config(config, r: int, decode: str):
    options = {**config.attention_options, "kv_lora_rank": r, "qk_nope_head_dim": config.head_dim,
               "qk_rope_head_dim": 0, "v_head_dim": config.head_dim, "kv_norm": False, "decode": decode,
               "out_bias": True}  # fmt: skip
    return dataclasses.replace(config, attention="mla", num_kv_heads=None, layer_kv_heads=None,
                               attention_options=options)  # fmt: skip


def to_mla(model: nn.Module, kv_rank: int, *, method: str = "activation", calibration: Iterable | None = None,
           decode: str = "absorbed"):  # fmt: skip
    """A new model whose every attention layer is "mla" with a latent of ``kv_rank`` channels.

    Args:
        model: a GPT, BertEncoder or SentenceEncoder whose layers are "mha",
            "gqa" or "mqa" without rope, qk_norm or sinks (left untouched);
            a pruned one keeps its per-layer query heads.
        kv_rank: r, the latent width, in [1, 2·G·D] (2·C for MHA).
        method: "activation" (default) or "svd" (module docstring);
            "activation" keeps far more of the model at every rank below
            full (docs/surgery.md: MiniLM at r = 128, mean cosine 0.96
            against 0.67).
        calibration: for "activation" only: batches run through ``model``
            (the forms of ``to_gqa``; padded positions are left out).
        decode: the "mla" layers' path, "absorbed" (the cache holds the
            latent: r elements per token and layer) or "naive".

    Returns:
        a model of the same class on the same device and dtype (a
        SentenceEncoder keeps its tokenizer, length limit and pooling),
        ``config.attention`` "mla" with ``attention_options`` kv_lora_rank
        = r, qk_rope_head_dim = 0, kv_norm = False.

    Raises:
        TypeError: another model class, a non-int kv_rank, a calibration
            batch of none of the accepted forms.
        ValueError: kv_rank out of range, a layer of another kind or with
            rope, qk_norm or sinks, an unknown method or decode path,
            "activation" without calibration or "svd" with it.
    """
    layers = _check(model, kv_rank, method, calibration)
    if decode not in ("absorbed", "naive"):
        raise ValueError(f"decode must be 'absorbed' or 'naive', got decode={decode!r}")
    moments = _input_moments(model, layers, calibration) if method == "activation" else [None] * len(layers)
    backbone, _ = backbone_of(model, "to_mla")
    new = rebuilt(backbone, _new_config(backbone.config, kv_rank, decode))
    _, new_layers = backbone_of(new, "to_mla")
    for old_layer, new_layer, layer_moments in zip(layers, new_layers, moments):
        _convert_layer(old_layer, new_layer, kv_rank, layer_moments)
    return finished(model, backbone, new)
