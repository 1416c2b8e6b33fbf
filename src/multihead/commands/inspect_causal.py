"""The roles of a causal model in ``multihead inspect``: scored, printed first, shown first on the page.

A GPT checkpoint (or run) and a causal Hugging Face model get the standard
causal head scores (``tools.causal_head_scores``: induction, previous-token,
duplicate-token on repeated random tokens, and the copying score of each
head's OV circuit) besides the roles on the text. An encoder gets none, and
its page and printout no causal section. The printout leads with::

    causal roles (8 sequences of 32 random tokens, each repeated; chance = an even spread):
      induction        >= 0.40   1 head    L1 H0 0.98
      previous_token   >= 0.40   1 head    L0 H0 1.00
      duplicate_token  >= 0.40   no head   closest: L1 H0 0.08 (chance 0.02)
      copying          >= 0.50   1 head    L1 H0 1.00

``--verbose`` adds one line per head with its four scores.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tools.causal_roles import ROLE_MEANINGS, ROLE_THRESHOLDS, CausalScores, causal_head_scores, special_token_ids

__all__ = ["SHOWN_ROLES", "LENGTH", "BATCH", "score_causal", "is_causal", "format_causal", "causal_view"]

#: The order the causal roles are listed in: induction and previous-token heads first.
SHOWN_ROLES = ("induction", "previous_token", "duplicate_token", "copying")
LENGTH, BATCH = 32, 8  # n and the number of sequences; n shrinks to fit a short context


def is_causal(model: nn.Module, hf: bool, vocab_size: int) -> bool:
    """Whether ``model`` hides later tokens: every head of a 4-token pass gives them exactly zero weight."""
    from ..tools.capture import capture

    ids = torch.arange(4)[None] % vocab_size  # (1, 4)
    if hf:
        from ..hf import capture as hf_capture

        recording = hf_capture(model)
    else:
        recording = capture(model)
    with torch.no_grad(), recording as record:
        model(ids)
    above = torch.ones(4, 4, dtype=torch.bool).triu(1)
    return all(bool((entry.weights[..., above] == 0).all()) for entry in record.layers)


def score_causal(
    model: nn.Module, *, vocab_size: int, context: int | None, tokenizer=None, unseen: list[int] = ()
) -> tuple[CausalScores | None, list[str]]:
    """The causal scores of ``model`` (and notices), on sequences that fit ``context``.

    Args:
        model: a causal multihead GPT, or a transformers model on ``multihead.hf``.
        vocab_size: the model's vocabulary.
        context: the longest sequence it takes (None: no limit).
        tokenizer: its tokenizer, whose special ids are never drawn (None: bytes).
        unseen: ids its training text never held (a run directory's), never drawn either.
    """
    length = LENGTH if context is None else min(LENGTH, context // 2)
    if length < 2:
        return None, [
            f"no causal roles: the context of {context} tokens cannot hold a sequence of 2 tokens and its repeat"
        ]
    exclude = [*(special_token_ids(tokenizer) if tokenizer is not None else []), *unseen]
    scores = causal_head_scores(model, vocab_size=vocab_size, length=length, batch=BATCH, exclude=exclude)
    return scores, [note.replace("copying: ", "no copying score for ", 1) for note in scores.notes]


def _heads_line(scores: CausalScores, role: str, per_role: int, width: int) -> str:
    limit, table = ROLE_THRESHOLDS[role], scores.scores[role]
    rule = f">= {limit:.2f}"
    found = scores.heads(role, limit)
    if not found:
        valid = [
            (float(table[i, j]), i, j)
            for i in range(table.shape[0])
            for j in range(table.shape[1])
            if table[i, j] == table[i, j]
        ]
        v, i, j = max(valid)
        return (
            f"  {role:<{width}}  {rule}  {'no head':>9}   closest: L{i} H{j} {v:.2f} (chance {scores.chance[role]:.2f})"
        )
    shown = ", ".join(f"L{i} H{j} {float(table[i, j]):.2f}" for i, j in found[:per_role])
    more = f", +{len(found) - per_role} more" if len(found) > per_role else ""
    heads = f"{len(found)} head" + ("s" if len(found) != 1 else "")
    return f"  {role:<{width}}  {rule}  {heads:>9}   {shown}{more}"


def format_causal(scores: CausalScores, *, verbose: bool = False, per_role: int = 4) -> str:
    """The printed causal block: each role's heads at or above its threshold, strongest first
    (with ``verbose`` every head's scores too)."""
    roles = [r for r in SHOWN_ROLES if r in scores.scores]
    width = max(map(len, SHOWN_ROLES))
    lines = [
        f"causal roles ({scores.batch} sequences of {scores.length} random tokens, each repeated; "
        f"chance = an even spread over the keys a query sees):",
        *(_heads_line(scores, role, per_role, width) for role in roles),
    ]
    if "copying" not in scores.scores:
        lines.append(f"  {'copying':<{width}}  {'':7}  {'-':>9}   not measurable on this model")
    if verbose:
        lines += ["", "  layer head " + " ".join(f"{r:>15}" for r in roles)]
        first = scores.scores[roles[0]]
        for i in range(first.shape[0]):
            for j in range(first.shape[1]):
                if first[i, j] != first[i, j]:  # the layer has fewer heads
                    continue
                values = " ".join(f"{_number(scores.scores[r][i, j]):>15}" for r in roles)
                lines.append(f"  {i:>5} {j:>4} {values}")
        for role in roles:
            lines.append(f"  {role}: {ROLE_MEANINGS[role]}; chance {scores.chance[role]:.3f}")
    return "\n".join(lines)


def _number(value: torch.Tensor) -> str:
    v = float(value)
    return "-" if v != v else f"{v:.3f}"


def causal_view(scores: CausalScores) -> dict:
    """What heads.html and heads.json show: ``CausalScores.to_dict()`` with the roles in the order
    shown and each one's meaning."""
    data = scores.to_dict()
    data["roles"] = [
        {"name": r, "meaning": ROLE_MEANINGS[r], "threshold": ROLE_THRESHOLDS[r], "chance": data["chance"][r]}
        for r in SHOWN_ROLES
        if r in scores.scores
    ]
    return data
