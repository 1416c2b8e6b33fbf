"""``multihead inspect --importance``: the table of heads with their ablation scores.

The importance of head h of layer l is measured by ablation: the text runs
through the model once whole and once with that head alone masked (its
context zeroed before the heads are merged), and the score is how much
worse the masked model does::

    GPT checkpoint         LM loss (nats/token) on the text, masked - whole
                           (``tools.objectives.gpt_importance``)
    encoder (MiniLM, BERT) 1 - cos(e_masked, e_whole), e the sentence
                           embedding (mean of the last hidden states;
                           ``tools.objectives.encoder_importance``,
                           ``hf.encoder_importance`` for a ``--hf`` folder)

Positive: the model needs the head on this text; about 0: it does not;
negative (LM loss only): the text is predicted better without it. One
forward per head plus one: L * H + 1 passes over one text.

A Hugging Face folder (``--hf``) is scored as an encoder (the base model
``AutoModel`` loads has no LM head), whatever its architecture.

A pruned model (layers with different head counts) is scored as [L, Hmax]
with NaN past a layer's heads: no head there. ``format_head_table`` prints
such a model with a "pruned" row for each removed head (``tools.head_slots``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..tools.roles import role_table

if TYPE_CHECKING:
    from ..tools.head_slots import HeadSlots

__all__ = ["IMPORTANCE_MEANING", "format_with_importance", "format_head_table"]

IMPORTANCE_MEANING = (
    "ablation: the loss increase when this head alone is masked (GPT: LM loss on the text, nats/token; "
    "encoder: 1 - cosine between the masked and unmasked mean-pooled text embedding)"
)


def format_with_importance(roles: Sequence, digits: int = 2) -> str:
    """``tools.roles.format_roles`` with an ``importance`` column (from each role's scores)."""
    return format_head_table(roles, importance=True, digits=digits)


def format_head_table(
    roles: Sequence,
    *,
    importance: bool,
    slots: HeadSlots | None = None,
    layers: Sequence[int] = (),
    digits: int = 2,
) -> str:
    """``tools.roles.format_roles``, with an ``importance`` column and a pruned model's removed heads.

    Args:
        roles: ``HeadRoles`` of the kept heads, in layer order.
        importance: add the ``importance`` column (each role's ``scores["importance"]``).
        slots: a pruned model's heads before pruning: each layer of ``layers``
            gets a row per removed head ("pruned" in its roles and importance),
            in slot order among the kept heads, and a column ``was`` gives each
            head's index before pruning when known.
        layers: the model layers shown (one per recorded call), for ``slots``.
        digits: decimals of the role scores.
    """
    rows = role_table(roles, digits)
    if importance:
        rows[0].append("importance")
        for row, r in zip(rows[1:], roles):
            value = r.scores.get("importance")
            row.append("-" if value is None or value != value else f"{value:.4f}")  # NaN: no head there
    if slots is not None:
        rows = _with_pruned(rows, roles, slots, layers, importance)
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(wd) for cell, wd in zip(row, widths)).rstrip() for row in rows)


def _with_pruned(rows: list[list[str]], roles: Sequence, slots: HeadSlots, layers: Sequence[int], importance: bool):
    """``rows`` (header + one per role) with a row per removed head, in slot order; a ``was`` column when known."""
    by_head = {}
    for row, r in zip(rows[1:], roles):
        by_head.setdefault((r.layer, r.head), []).append(row)
    width = len(rows[0])
    out, seen = [rows[0]], {}
    for layer in layers:
        k = seen[layer] = seen.get(layer, -1) + 1  # the k-th call of this layer
        for slot, head in enumerate(slots.slots(layer)):
            if head is None:
                row = [str(layer), "-", "pruned", *["-"] * (width - 3)]
                if importance:
                    row[-1] = "pruned"
            else:
                calls = by_head.get((layer, head), [])
                if k >= len(calls):
                    continue
                row = calls[k]
            out.append(row if not slots.original else [*row[:2], str(slot), *row[2:]])
    if slots.original:
        out[0] = [*out[0][:2], "was", *out[0][2:]]
    return out
