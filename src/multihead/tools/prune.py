"""Remove attention heads for good: fewer parameters, fewer FLOPs, smaller caches.

    prune_heads(model, {0: [1, 3], 2: [0]})   # in place, like Hugging Face's
    prune_closed_heads(model)                 # "gated" models: heads whose gate is 0

Each pruned layer is the layer's own ``select_heads`` of the heads it
keeps (``AttentionLayer.select_heads``): a removed query head takes with it
its rows of the query projection (and bias), its input columns of
``out_proj`` and its per-head parameters; the model then computes what
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
  a new attention module (checked against the layer the updated config
  builds, as ``load_checkpoint`` would build it), and
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
pruned) and the encoder-decoder ``Transformer``, with every attention
kind that declares ``independent_heads`` (docs/variants.md lists them; the
gated kind's ``log_alpha`` goes with its heads). Kinds whose heads mix with
each other cannot lose one head alone and are refused with the reason the
kind gives (``head_independence``). A Transformer's layers are numbered as
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

from torch import nn

from ..modules.base import AttentionLayer
from ..modules.head_selection import check_head_selection
from .heads import check_index
from .prune_targets import PruneTarget, prune_target

__all__ = ["prune_heads", "prune_closed_heads"]


# ------------------------------------------------------------------ checks and plans
def _check_table(heads_to_prune: object, layers: list[AttentionLayer]) -> dict[int, list[int]]:
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


def _plan(i: int, layer: AttentionLayer, removed: list[int]) -> tuple[list[int], list[int]]:
    """(kept query heads, kept key/value heads) of layer i, or a ValueError naming the layer."""
    H = layer.num_heads
    if len(removed) == H:
        raise ValueError(
            f"layer {i} would keep no heads (removing all of its {H}: {removed}); a layer keeps at least one head"
        )
    keep = [h for h in range(H) if h not in set(removed)]
    try:
        return check_head_selection(keep, None, H, layer.num_kv_heads)
    except ValueError as err:
        raise ValueError(f"layer {i}: removing heads {removed}: {err}") from None


def _selected(target: PruneTarget, config, i: int, old: AttentionLayer, keep_q, keep_kv) -> AttentionLayer:
    """``old.select_heads``, checked against the layer ``config`` builds (what loading the model would build)."""
    new = old.select_heads(keep_q, keep_kv)
    built = target.build(config, i, old.out_proj.weight.dtype)
    shapes = {k: tuple(v.shape) for k, v in new.state_dict().items()}
    if type(built) is not type(new) or built.scale != new.scale or shapes != {
        k: tuple(v.shape) for k, v in built.state_dict().items()
    }:
        raise ValueError(
            f"layer {i}: its pruned {type(new).__name__} (scale={new.scale}, weights {shapes}) differs from the "
            f"{type(built).__name__} (scale={built.scale}) that the model's config builds with these head counts, "
            "so the pruned model could not be saved and loaded; set the options that depend on the head count "
            "(such as scale) in the config's attention_options"
        )
    return new


# ------------------------------------------------------------------ public
def prune_heads(model: nn.Module, heads_to_prune: Mapping[int, list[int]]) -> nn.Module:
    """Remove the given query heads (and key/value heads left without queries) in place.

    Args:
        model: a ``GPT``, ``BertEncoder``, ``SentenceEncoder`` or
            encoder-decoder ``Transformer`` whose attention kind declares
            ``independent_heads``.
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
    rebuilt = {i: _selected(target, config, i, layers[i], *plan) for i, plan in plans.items()}
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
        ValueError: a model whose attention kind has no head gates (``closed_heads``), a layer
            whose heads are all closed, or closed heads that leave GQA
            groups of different sizes (see :func:`prune_heads`).
    """
    target = prune_target(model)
    kind = target.model.config.attention
    layers = target.layers
    if not all(callable(getattr(layer, "closed_heads", None)) for layer in layers):
        raise ValueError(
            f"prune_closed_heads needs an attention kind with head gates (closed_heads(), as 'gated'), "
            f"got attention={kind!r}"
        )
    table = {i: layer.closed_heads() for i, layer in enumerate(layers)}
    table = {i: heads for i, heads in table.items() if heads}
    prune_heads(model, table)
    return table
