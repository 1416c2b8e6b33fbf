"""Convert a trained model's multi-head attention into grouped-query attention.

    to_gqa(model, num_kv_heads=G)                                   "mean"
    to_gqa(model, G, method="aligned", calibration=[x0, x1, ...])   "aligned"

``model`` is a GPT, a BertEncoder or a SentenceEncoder (its ``encoder`` is
converted; tokenizer and pooling are kept). Calibration batches follow the
model's forward::

    GPT               input_ids [B, T]
    BertEncoder       input_ids [B, T] (no padding), or a pair
                      (input_ids [B, T], attention_mask [B, T], 1 = real token),
                      or an object with .input_ids and .attention_mask (Tokenized)
    SentenceEncoder   any of the BertEncoder forms, or a list of sentences (str),
                      tokenised by the model

Keys and values at padded positions (attention_mask 0) are left out of the
statistics of "aligned".

Every attention layer keeps its H query heads and gets G key/value heads;
query head h reads key/value head h // (H // G)::

    H = 4, G = 2:   q0 q1 | q2 q3        query heads
                     \\ /     \\ /
                     kv0     kv1         key/value heads (merged)

"mean" (GQA's own recipe, Ainslie et al. 2023): the key projection of a
group (weight rows and bias) is the mean of its heads', and so is the value
projection; queries and ``out_proj`` are unchanged. Heads whose keys and
values were already identical convert exactly.

"aligned" (Jin et al. 2024, "Align attention heads before merging them",
arXiv 2412.20677): heads are first made as alike as possible by rotations
that leave the model's function unchanged, then averaged.

1. Calibration: the token batches [B, T] run through the model; each
   layer's keys k_h and values v_h [N, D] are collected per head (after the
   projection and its bias) at the N real (unpadded) positions.
2. Grouping: for every pair of heads, the orthogonal Procrustes rotation
   aligning one onto the other and the remaining relative error
   ``|X_i R - X_j|^2 / (|X_i|^2 + |X_j|^2)`` (keys plus values). Groups of
   equal size minimise the sum of pairwise errors inside groups: every
   partition is tried when there are at most ``_EXHAUSTIVE_LIMIT`` of them
   (H = 4, 8: all of them; the paper searches with simulated annealing),
   otherwise a greedy pass takes the lowest free head and adds its closest
   free heads. Heads are then permuted so that groups are consecutive (a
   permutation of heads, with the matching columns of ``out_proj``, is
   exact).
3. Alignment: inside a group, generalized Procrustes analysis (as the
   paper's code): each head's keys are rotated onto the first head's, then
   repeatedly onto the mean of the rotated keys until the mean stops
   moving; separately for values. R_h [D, D] is orthogonal.
4. Folding, which keeps the model's function exactly::

       keys     k_h R_h              W_k,h <- R_h^T W_k,h,   b_k,h <- R_h^T b_k,h
       queries  q_h R_h              (q_h R_h)(k_h R_h)^T = q_h k_h^T
       values   v_h R_h              W_v,h <- R_h^T W_v,h,   b_v,h <- R_h^T b_v,h
       out_proj columns of head h    W_o[:, h] <- W_o[:, h] R_h   (P v R R^T W_o^T = P v W_o^T)

   then the rotated key and value projections of a group are averaged as in
   "mean". Heads that are exact rotations of each other convert exactly.

Rotary positions rotate q and k in fixed channel planes, which a general
R_h does not commute with, and qk_norm's per-channel gain does not commute
with a rotation either; "aligned" refuses layers with rope or qk_norm
("mean" takes them). A source that already has G0 < H key/value heads
merges its G0 heads the same way (G must divide G0). A pruned model whose
layers kept different numbers of query heads (``layer_heads``) is converted
layer by layer, each to G key/value heads (G must divide every layer's
count); its per-layer query counts stay.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from collections.abc import Iterable

import torch
from torch import nn

from ..modules.kinds.mha import MultiHeadAttention
from ..modules.registry import attention_class
from .calibration import backbone_of, check_kind, finished, rebuilt, run_calibration

__all__ = ["to_gqa", "METHODS"]

METHODS = ("mean", "aligned")
_EXHAUSTIVE_LIMIT = 20_000  # partitions of the heads into groups tried one by one
_GPA_ITERATIONS = 100
_GPA_TOL = 1e-10


# ------------------------------------------------------------------ checks
def _check(model: nn.Module, num_kv_heads: int, method: str, calibration) -> list[MultiHeadAttention]:
    backbone, attentions = backbone_of(model, "to_gqa")
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int):
        raise TypeError(f"num_kv_heads must be an int, got num_kv_heads={num_kv_heads!r}")
    if method not in METHODS:
        raise ValueError(f"unknown method={method!r}; valid methods: {list(METHODS)}")
    H = backbone.config.num_heads
    counts = backbone.config.layer_heads
    if counts is None:
        if num_kv_heads < 1 or num_kv_heads > H:
            raise ValueError(f"num_kv_heads must be in [1, num_heads={H}], got num_kv_heads={num_kv_heads}")
        if H % num_kv_heads:
            raise ValueError(f"num_kv_heads={num_kv_heads} does not divide num_heads={H}")
    elif num_kv_heads < 1 or num_kv_heads > min(counts):
        raise ValueError(
            f"num_kv_heads must be in [1, {min(counts)}] (the fewest query heads of a layer: the model's "
            f"layers have {counts} after pruning), got num_kv_heads={num_kv_heads}"
        )
    layers = []
    for i, attn in enumerate(attentions):
        check_kind(i, attn, "to_gqa")
        G0 = attn.num_kv_heads
        if G0 % num_kv_heads:
            raise ValueError(
                f"layer {i} has {G0} key/value heads ({attn.num_heads} query heads); "
                f"num_kv_heads={num_kv_heads} must divide it"
            )
        if method == "aligned" and (attn.rope is not None or attn.qk_norm is not None):
            raise ValueError(
                f"method='aligned' rotates keys, which does not commute with rope or qk_norm; layer {i} has "
                f"rope={attn.rope is not None}, qk_norm={attn.qk_norm is not None} (use method='mean')"
            )
        layers.append(attn)
    if method == "aligned" and calibration is None:
        raise ValueError("method='aligned' needs calibration: an iterable of token batches (see to_gqa)")
    if method == "mean" and calibration is not None:
        raise ValueError("method='mean' takes no calibration (got one); it is used by method='aligned'")
    return layers


# ------------------------------------------------------------- calibration
@torch.no_grad()
def _collect(model: nn.Module, layers: list[MultiHeadAttention], calibration: Iterable) -> list[tuple[torch.Tensor, ...]]:
    """Keys and values of every layer's kv heads at the real (unpadded)
    calibration tokens: per layer (k, v), each float64 [G0, N, D]."""
    backbone, _ = backbone_of(model, "to_gqa")
    inputs: list[list[tuple[torch.Tensor, torch.Tensor | None]]] = [[] for _ in layers]

    def keep(i: int):
        def hook(module, args, kwargs):
            inputs[i].append((args[0], kwargs.get("key_mask")))  # x (B, T, C), mask (B, T) or None

        return hook

    run_calibration(model, backbone, layers, calibration, keep)
    out = []
    for layer, xs in zip(layers, inputs):
        ks, vs = [], []
        for x, mask in xs:  # x (B, T, C), mask (B, T) bool, True = real token
            _, k, v = layer.project(x)  # k, v: (B, G0, T, D)
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # (B, G0, T, D) -> (G0, B, T, D)
            if mask is None:
                ks.append(k.flatten(1, 2))  # (G0, B, T, D) -> (G0, B*T, D)
                vs.append(v.flatten(1, 2))
            else:
                ks.append(k[:, mask.bool()])  # (G0, B, T, D) -> (G0, N_real, D)
                vs.append(v[:, mask.bool()])
        out.append((torch.cat(ks, 1).double(), torch.cat(vs, 1).double()))
    return out


# ------------------------------------------------------------- procrustes
def _procrustes(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Orthogonal R [D, D] minimising |x R - target|_F for x, target [N, D]."""
    U, _, Vh = torch.linalg.svd(x.T @ target)
    return U @ Vh


def _pair_errors(data: torch.Tensor) -> torch.Tensor:
    """[n, n] relative error left after aligning head i onto head j, data [n, N, D]."""
    n = data.shape[0]
    err = torch.zeros(n, n, dtype=torch.float64)
    sq = data.pow(2).sum((1, 2))
    for i, j in itertools.combinations(range(n), 2):
        R = _procrustes(data[i], data[j])
        e = (data[i] @ R - data[j]).pow(2).sum() / (sq[i] + sq[j]).clamp_min(1e-300)
        err[i, j] = err[j, i] = e
    return err


def _partitions(items: list[int], size: int):
    """Every partition of ``items`` into groups of ``size``, each group sorted, groups ordered by first item."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        left = [x for x in rest if x not in others]
        for tail in _partitions(left, size):
            yield [[first, *others], *tail]


def _count_partitions(n: int, size: int) -> int:
    groups = n // size
    return math.factorial(n) // (math.factorial(size) ** groups * math.factorial(groups))


def _group_heads(err: torch.Tensor, G: int) -> list[list[int]]:
    """Equal groups of heads minimising the summed pairwise error inside groups."""
    n = err.shape[0]
    size = n // G
    if size == 1:
        return [[i] for i in range(n)]

    def cost(groups) -> float:
        return sum(float(err[i, j]) for g in groups for i, j in itertools.combinations(g, 2))

    if _count_partitions(n, size) <= _EXHAUSTIVE_LIMIT:
        return min(_partitions(list(range(n)), size), key=cost)
    free, groups = list(range(n)), []
    while free:
        first = free.pop(0)
        closest = sorted(free, key=lambda j: float(err[first, j]))[: size - 1]
        free = [j for j in free if j not in closest]
        groups.append([first, *sorted(closest)])
    return groups


def _generalized_procrustes(data: torch.Tensor) -> torch.Tensor:
    """Rotations R [n, D, D] bringing every head of data [n, N, D] onto a common mean."""
    n, _, D = data.shape
    target = data[0]
    rotations = torch.eye(D, dtype=data.dtype).repeat(n, 1, 1)
    for _ in range(_GPA_ITERATIONS):
        rotations = torch.stack([_procrustes(data[i], target) for i in range(n)])
        mean = (data @ rotations).mean(0)  # (n, N, D) @ (n, D, D) -> (N, D)
        moved = (mean - target).norm() / target.norm().clamp_min(1e-300)
        target = mean
        if moved < _GPA_TOL:
            break
    return rotations


# ------------------------------------------------------------- conversion
def _new_config(config, G: int):
    """The config with G key/value heads in every layer.

    Per-layer query counts (a pruned model) stay; G goes into ``num_kv_heads``
    where it divides ``num_heads``, as a config requires, else into
    ``layer_kv_heads`` under the smallest divisor of ``num_heads`` above it.
    The kind is named by its class (``kind_name``): the mha family's name
    follows G, a subclass that declares its own ``kind`` keeps it.
    """
    H, counts = config.num_heads, config.layer_heads
    name = attention_class(config.attention).kind_name
    if counts is None:
        return dataclasses.replace(config, attention=name(H, G), num_kv_heads=None if G == H else G)
    if all(h == G for h in counts):
        return dataclasses.replace(config, attention=name(G, G), num_kv_heads=None, layer_kv_heads=None)
    kind = name(H, G)  # G < H here: every layer keeps more query heads than G
    if H % G == 0:
        return dataclasses.replace(config, attention=kind, num_kv_heads=G, layer_kv_heads=None)
    top = min(d for d in range(G, H + 1) if H % d == 0)
    return dataclasses.replace(config, attention=kind, num_kv_heads=top, layer_kv_heads=[G] * len(counts))


@torch.no_grad()
def _convert_layer(old: MultiHeadAttention, new: MultiHeadAttention, G: int, stats) -> None:
    """Write ``new``'s q/k/v/out weights from ``old`` (computed in float64).

    stats: None ("mean") or this layer's calibration (k, v), each [G0, N, D].
    """
    H, G0, D = old.num_heads, old.num_kv_heads, old.head_dim
    r = H // G0  # query heads per old kv head
    weights = {n: (w.double(), None if b is None else b.double()) for n, (w, b) in old.projection_weights().items()}
    wq, bq = weights["q"]
    wk, bk = weights["k"]
    wv, bv = weights["v"]
    wo = old.out_proj.weight.double()  # (C, H*D)
    C_in = wq.shape[1]
    wq = wq.reshape(G0, r, D, C_in)  # (H*D, C) -> (G0, r, D, C)
    wk, wv = wk.reshape(G0, D, -1), wv.reshape(G0, D, -1)  # (G0*D, C) -> (G0, D, C)
    wo = wo.reshape(wo.shape[0], G0, r, D)  # (C, H*D) -> (C, G0, r, D)
    bq = None if bq is None else bq.reshape(G0, r, D)
    bk = None if bk is None else bk.reshape(G0, D)
    bv = None if bv is None else bv.reshape(G0, D)
    size = G0 // G
    if stats is None:
        groups = [list(range(g * size, (g + 1) * size)) for g in range(G)]
    else:
        keys, values = stats
        err = _pair_errors(keys) + _pair_errors(values)
        groups = _group_heads(err, G)
        order = [j for g in groups for j in g]
        keys, values = keys[order], values[order]
        wq, wk, wv, wo = wq[order], wk[order], wv[order], wo[:, order]
        bq = None if bq is None else bq[order]
        bk = None if bk is None else bk[order]
        bv = None if bv is None else bv[order]
        rk = torch.cat([_generalized_procrustes(keys[g * size : (g + 1) * size]) for g in range(G)])  # (G0, D, D)
        rv = torch.cat([_generalized_procrustes(values[g * size : (g + 1) * size]) for g in range(G)])
        rkT, rvT = rk.transpose(1, 2), rv.transpose(1, 2)
        wq = torch.einsum("jed,jrdc->jrec", rkT, wq)  # W_q,h <- R^T W_q,h for each query head of kv head j
        wk = rkT @ wk  # (G0, D, D) @ (G0, D, C)
        wv = rvT @ wv
        wo = torch.einsum("cjrd,jde->cjre", wo, rv)  # W_o[:, h] <- W_o[:, h] R
        bq = None if bq is None else torch.einsum("jed,jrd->jre", rkT, bq)
        bk = None if bk is None else (rkT @ bk[..., None])[..., 0]
        bv = None if bv is None else (rvT @ bv[..., None])[..., 0]
    wk = wk.reshape(G, size, D, -1).mean(1).reshape(G * D, -1)  # (G0, D, C) -> (G, D, C) -> (G*D, C)
    wv = wv.reshape(G, size, D, -1).mean(1).reshape(G * D, -1)
    bk = None if bk is None else bk.reshape(G, size, D).mean(1).reshape(G * D)
    bv = None if bv is None else bv.reshape(G, size, D).mean(1).reshape(G * D)
    new_weights = new.projection_weights()
    for name, (w, b) in (
        ("q", (wq.reshape(H * D, -1), None if bq is None else bq.reshape(H * D))),
        ("k", (wk, bk)),
        ("v", (wv, bv)),
    ):
        target_w, target_b = new_weights[name]
        target_w.copy_(w)
        if target_b is not None:
            target_b.copy_(b)
    new.out_proj.weight.copy_(wo.reshape(wo.shape[0], H * D))  # (C, G0, r, D) -> (C, H*D)
    if old.out_proj.bias is not None:
        new.out_proj.bias.copy_(old.out_proj.bias)


def to_gqa(model: nn.Module, num_kv_heads: int, *, method: str = "mean", calibration: Iterable | None = None):
    """A new model whose every attention layer has ``num_kv_heads`` key/value heads.

    Args:
        model: a GPT, BertEncoder or SentenceEncoder whose layers are "mha",
            "gqa" or "mqa" (left untouched); a pruned one with per-layer
            head counts keeps them.
        num_kv_heads: G, dividing every layer's current key/value head
            count (its query heads for MHA).
        method: "mean" (average each group's key and value projections) or
            "aligned" (rotate heads onto each other first; see the module
            docstring).
        calibration: for "aligned" only: batches run through ``model`` to
            collect keys and values: token ids [B, T] int64; for encoders
            also (input_ids [B, T], attention_mask [B, T]) pairs or
            ``Tokenized`` batches, and for a SentenceEncoder lists of
            sentences (the forms in the module docstring). Padded positions
            are left out. Use data the converted model will not be
            evaluated on.

    Returns:
        a model of the same class on the same device and dtype (a
        SentenceEncoder keeps its tokenizer, length limit and pooling),
        attention kind "gqa" (or "mqa" for G = 1, "mha" for G = H),
        ``config.num_kv_heads`` = G; query heads are unchanged ("mean") or
        rotated and permuted with their keys ("aligned"). G equal to the
        current count returns a copy.

    Raises:
        TypeError: another model class, a non-int num_kv_heads, a
            calibration batch of none of the accepted forms.
        ValueError: G outside [1, H], G not dividing the key/value head
            count, a layer of another attention kind, an unknown method,
            "aligned" without calibration or with rope/qk_norm layers, or
            calibration given to "mean".
    """
    layers = _check(model, num_kv_heads, method, calibration)
    G = num_kv_heads
    if all(layer.num_kv_heads == G for layer in layers):
        return copy.deepcopy(model)
    stats = _collect(model, layers, calibration) if method == "aligned" else [None] * len(layers)
    backbone, _ = backbone_of(model, "to_gqa")
    new = rebuilt(backbone, _new_config(backbone.config, G))
    _, new_layers = backbone_of(new, "to_gqa")
    for old_layer, new_layer, layer_stats in zip(layers, new_layers, stats):
        _convert_layer(old_layer, new_layer, G, layer_stats)
    return finished(model, backbone, new)
