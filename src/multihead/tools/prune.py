"""Remove attention heads for good: fewer parameters, fewer FLOPs, smaller caches.

    prune_heads(model, {0: [1, 3], 2: [0]})   # in place, like Hugging Face's
    prune_closed_heads(model)                 # "gated" models: heads whose gate is 0

A removed query head takes with it its rows of the query projection (and
bias) and its input columns of ``out_proj``; the model then computes what
it computed with those heads masked (``tools.heads.mask_heads``: their
contexts zeroed), up to float rounding. The other heads keep their order
and are renumbered 0 .. H'-1; ``out_proj``'s bias stays.

Grouped-query attention: query head h reads key/value head h // (H // G).
A key/value head (its rows of the key and value projections) goes only
when every query head of its group goes. The map h -> h // (H' // G')
after pruning must still hold, so every group that keeps any query head
must keep the same number of them; anything else is refused with an error
naming each group's count::

    H = 6, G = 3:  q0 q1 | q2 q3 | q4 q5        remove [2, 3]    -> kv1 goes; H' = 4, G' = 2
                    kv0     kv1     kv2         remove [0, 2, 4] -> one per group; H' = 3, G' = 3
                                                remove [0]       -> refused: groups keep 1, 2, 2

Choices, and how they differ from Hugging Face's ``prune_heads``:

* In place: the model object is changed and returned. Each pruned layer is
  a new attention module (built from the updated config as
  ``load_checkpoint`` would build it, then given the kept weights), and
  ``model.config`` is a new config object listing per-layer head counts
  (``layer_heads``, ``layer_kv_heads``; head_dim stays that of the unpruned
  model). Hooks or observers registered on a pruned layer, KV caches made
  before pruning and optimizers holding the old parameters belong to the
  old modules: make them again.
* Head indices are those of the model as it is now (as for ``mask_heads``
  and ``head_importance``), not of the unpruned model; after pruning, heads
  are renumbered. Hugging Face counts in the original numbering and skips
  heads already pruned.
* A layer keeps at least one head: removing every head of a layer is
  refused (Hugging Face allows it; the layer's output would be only
  ``out_proj``'s bias, which an attention layer of zero heads cannot
  represent here: every layer has num_heads >= 1).
* Duplicate head indices are an error, not ignored.

Models: ``GPT``, ``BertEncoder``, a ``SentenceEncoder`` (its encoder is
pruned) and the encoder-decoder ``Transformer``, with attention kinds "mha",
"gqa", "mqa" and "gated" (whose gate parameters ``log_alpha`` are pruned
with their heads). Kinds whose heads mix with each other ("moh", "dcmha",
"talking_heads", "overlapping", "collaborative") cannot lose one head alone
and are refused. A Transformer's layers are numbered as
``attention_layers`` numbers them, encoder first, then each decoder layer's
self- and cross-attention (``tools.prune_targets`` draws the map)::

    N_enc = 2, N_dec = 2:   0 encoder.0.self_attn    2 decoder.0.self_attn   3 decoder.0.cross_attn
                            1 encoder.1.self_attn    4 decoder.1.self_attn   5 decoder.1.cross_attn

and its config lists the counts per role (``encoder_layer_heads`` = [H0, H1],
``decoder_layer_heads`` = [H2, H4], ``cross_layer_heads`` = [H3, H5], and the
``*_layer_kv_heads`` alike), so ``head_importance`` and ``mask_heads``
tables go to ``prune_heads`` unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..modules.kinds.gated import GatedHeadAttention
from ..modules.kinds.mha import MultiHeadAttention
from .heads import check_index
from .prune_targets import PruneTarget, prune_target

__all__ = ["prune_heads", "prune_closed_heads"]


# ------------------------------------------------------------------ checks and plans
def _check_table(heads_to_prune: object, layers: list[MultiHeadAttention]) -> dict[int, list[int]]:
    """{layer: sorted heads} from the user's table; every index checked, duplicates refused."""
    if not isinstance(heads_to_prune, Mapping):
        raise TypeError(
            f"heads_to_prune must be a mapping {{layer_index: [head, ...]}}, got {type(heads_to_prune).__name__}"
        )
    table: dict[int, list[int]] = {}
    for layer, chosen in heads_to_prune.items():
        i = check_index("layer index", layer, len(layers), f" ({len(layers)} attention layers)")
        if isinstance(chosen, (str, bytes)) or not hasattr(chosen, "__iter__"):
            raise TypeError(f"heads_to_prune[{layer}] must be a list of head indices, got {chosen!r}")
        H = layers[i].num_heads
        listed = [check_index("head", h, H, f" in layer {i} with {H} heads") for h in chosen]
        repeated = sorted({h for h in listed if listed.count(h) > 1})
        if repeated:
            raise ValueError(f"heads_to_prune[{layer}] lists head(s) {repeated} more than once: {listed}")
        table[i] = sorted(listed)
    return table


def _plan(i: int, layer: MultiHeadAttention, removed: list[int]) -> tuple[list[int], list[int]]:
    """(kept query heads, kept key/value heads) of layer i, or a ValueError."""
    H, G = layer.num_heads, layer.num_kv_heads
    if len(removed) == H:
        raise ValueError(
            f"layer {i} would keep no heads (removing all of its {H}: {removed}); a layer keeps at least one head"
        )
    r = H // G  # query heads per key/value head
    keep_q = [h for h in range(H) if h not in set(removed)]
    per_group = {g: sum(1 for h in keep_q if h // r == g) for g in range(G)}
    keep_kv = [g for g, n in per_group.items() if n > 0]
    sizes = {per_group[g] for g in keep_kv}
    if len(sizes) > 1:
        raise ValueError(
            f"layer {i}: query head h reads key/value head h // {r}; removing heads {removed} leaves its key/value "
            f"groups with different numbers of query heads {per_group} (group: kept heads). Remove the same number "
            "of query heads from every group, or whole groups"
        )
    return keep_q, keep_kv


# ------------------------------------------------------------------ weights
def _rows(heads: list[int], D: int, offset: int, device: torch.device) -> torch.Tensor:
    """Row indices of the given heads in a projection whose rows are head-major blocks of D."""
    idx = torch.tensor(heads, dtype=torch.long, device=device)
    return (offset + idx[:, None] * D + torch.arange(D, device=device)).reshape(-1)  # (n, D) -> (n*D,)


def _pruned_state(layer: MultiHeadAttention, keep_q: list[int], keep_kv: list[int]) -> dict[str, torch.Tensor]:
    """``layer.state_dict()`` with only the kept heads' rows, columns and gates."""
    H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    device = layer.out_proj.weight.device
    q_rows, kv_rows = _rows(keep_q, D, 0, device), _rows(keep_kv, D, 0, device)
    if layer.fused:  # qkv_proj rows: [q heads (H*D) | k heads (G*D) | v heads (G*D)]
        rows = {"qkv_proj": torch.cat([q_rows, H * D + kv_rows, (H + G) * D + kv_rows])}
    else:
        rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
    state = dict(layer.state_dict())
    for name, idx in rows.items():
        for suffix in ("weight", "bias"):
            if f"{name}.{suffix}" in state:
                state[f"{name}.{suffix}"] = state[f"{name}.{suffix}"][idx]
    state["out_proj.weight"] = state["out_proj.weight"][:, q_rows]  # (C, H*D) -> (C, H'*D)
    if "log_alpha" in state:  # gated: one gate per query head
        state["log_alpha"] = state["log_alpha"][torch.tensor(keep_q, dtype=torch.long, device=device)]
    return state


@torch.no_grad()
def _rebuilt(target: PruneTarget, config, i: int, old: MultiHeadAttention, keep_q, keep_kv) -> nn.Module:
    ref = old.out_proj.weight
    new = target.build(config, i, ref.dtype)
    if type(new) is not type(old) or new.head_dim != old.head_dim:
        raise ValueError(
            f"layer {i} is a {type(old).__name__} with head_dim={old.head_dim}, but the model's config builds a "
            f"{type(new).__name__} with head_dim={new.head_dim}; prune_heads needs layers as the config describes"
        )
    new = new.to_empty(device=ref.device)
    new.load_state_dict(_pruned_state(old, keep_q, keep_kv), strict=True)
    grads = {name: p.requires_grad for name, p in old.named_parameters()}
    for name, p in new.named_parameters():
        p.requires_grad_(grads[name])
    return new.train(old.training)


# ------------------------------------------------------------------ public
def prune_heads(model: nn.Module, heads_to_prune: Mapping[int, list[int]]) -> nn.Module:
    """Remove the given query heads (and key/value heads left without queries) in place.

    Args:
        model: a ``GPT``, ``BertEncoder``, ``SentenceEncoder`` or
            encoder-decoder ``Transformer`` whose attention kind is "mha",
            "gqa", "mqa" or "gated".
        heads_to_prune: ``{layer_index: [head, ...]}``; layers numbered as
            ``tools.heads.attention_layers`` numbers them, heads as the
            layer numbers them now (0 .. H-1). An empty list changes nothing.

    Returns:
        ``model`` itself, pruned: each pruned layer is a new attention module
        with H' query heads and G' key/value heads; ``model.config`` is a new
        config with ``layer_heads`` (and ``layer_kv_heads`` when the config
        sets ``num_kv_heads``); a Transformer's with ``encoder_layer_heads``,
        ``decoder_layer_heads`` and ``cross_layer_heads`` (and their
        ``*_layer_kv_heads``), see the module docstring. Its output equals
        that of the unpruned model under ``mask_heads(model, heads_to_prune)``
        up to float rounding.

    Raises:
        TypeError: another kind of model, a table that is not a mapping of
            int -> list of ints.
        ValueError: a layer or head index out of range, a head listed twice,
            a layer that would keep no head, a GQA layer whose groups would
            keep different numbers of query heads, or an attention kind
            whose heads cannot be removed one by one (the message names it).
        All checks run before anything changes.
    """
    target = prune_target(model)
    layers = target.layers
    table = _check_table(heads_to_prune, layers)
    plans = {i: _plan(i, layers[i], removed) for i, removed in table.items() if removed}
    if not plans:
        return model
    heads = [len(plans[i][0]) if i in plans else layer.num_heads for i, layer in enumerate(layers)]
    kv = [len(plans[i][1]) if i in plans else layer.num_kv_heads for i, layer in enumerate(layers)]
    config = target.with_counts(heads, kv)
    rebuilt = {i: _rebuilt(target, config, i, layers[i], *plan) for i, plan in plans.items()}
    for i, attention in rebuilt.items():
        target.set_layer(i, attention)
    target.model.config = config
    return model


def prune_closed_heads(model: nn.Module) -> dict[int, list[int]]:
    """Remove every head whose eval-mode gate is exactly 0 from a "gated" model, in place.

    A closed head (``GatedHeadAttention.closed_heads()``) contributes
    nothing, so the model's eval-mode output is unchanged up to float
    rounding; the remaining gates (``log_alpha``) keep their values.

    Returns:
        the heads removed, ``{layer_index: [head, ...]}`` in the numbering
        before pruning (layers without closed heads left out).

    Raises:
        TypeError: see :func:`prune_heads`.
        ValueError: a model whose attention kind is not "gated", a layer
            whose heads are all closed, or closed heads that leave GQA
            groups of different sizes (see :func:`prune_heads`).
    """
    target = prune_target(model)
    kind = target.model.config.attention
    if kind != "gated":
        raise ValueError(f"prune_closed_heads needs attention kind 'gated', got attention={kind!r}")
    layers = target.layers
    table = {i: layer.closed_heads() for i, layer in enumerate(layers) if isinstance(layer, GatedHeadAttention)}
    table = {i: heads for i, heads in table.items() if heads}
    prune_heads(model, table)
    return table
