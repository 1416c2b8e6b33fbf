"""The standard head roles of causal models, scored on repeated random tokens.

    scores = causal_head_scores(model, vocab_size=model.config.vocab_size)
    scores.scores["induction"]          # [L, H], each in [0, 1]
    scores.heads("induction", 0.4)      # [(layer, head), ...] at or above 0.4

The input is ``batch`` sequences of ``length`` token ids drawn uniformly
(seeded) from the model's vocabulary, each repeated once::

    tokens  r1 r2 ... rn r1 r2 ... rn          T = 2n
    index   0  1  ... n-1 n  n+1 ... 2n-1

A head's weights A [T, T] (one batch item, post-softmax) give, averaged over
the rows named and then over the batch:

    previous_token   A[i, i-1]    for i in 1 .. 2n-1    (Elhage et al. 2021)
    duplicate_token  A[i, i-n]    for i in n .. 2n-1    (the same token's
                                                          earlier occurrence)
    induction        A[i, i-n+1]  for i in n .. 2n-1    (the token after it:
                                                          prefix matching,
                                                          Olsson et al. 2022)

A head that spreads its weight evenly over the i + 1 keys it sees scores
about ln(2n)/(2n) on each, so a score well above that is the head's choice.
Random tokens carry no meaning, so a head that attends to a token's
successor here does so by the induction mechanism, not by what it knows of
language. Signed weights (DCMHA, talking heads, differential attention)
are read as they are: a negative weight lowers the score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._checks import positive_int
from .capture import capture
from .heads import eval_mode

__all__ = ["CAUSAL_ROLES", "CausalScores", "repeated_random_tokens", "causal_head_scores"]

#: The roles scored, in the order tables show them.
CAUSAL_ROLES = ("previous_token", "duplicate_token", "induction")


@dataclass
class CausalScores:
    """Per-head scores of each causal role.

    Attributes:
        scores: role name -> [L, H] float tensor (L attention layers in
            ``capture`` order, H the most heads of any layer; a layer with
            fewer heads has NaN in the columns it lacks).
        layer_names: the L attention modules' names.
        length: n, the length of each random sequence before its repeat.
        batch: the number of sequences averaged.
        seed: the seed that drew them.
    """

    scores: dict[str, torch.Tensor]
    layer_names: list[str]
    length: int
    batch: int
    seed: int

    def heads(self, role: str, threshold: float) -> list[tuple[int, int]]:
        """The (layer, head) pairs whose ``role`` score is at least ``threshold``, best first."""
        if role not in self.scores:
            raise ValueError(f"unknown role {role!r}; the scored roles are {sorted(self.scores)}")
        s = self.scores[role]
        found = [(float(s[i, j]), i, j) for i in range(s.shape[0]) for j in range(s.shape[1]) if s[i, j] >= threshold]
        return [(i, j) for _, i, j in sorted(found, key=lambda x: -x[0])]

    def to_dict(self) -> dict:
        """JSON-ready: role -> L lists of H floats (None where a layer lacks the head)."""
        return {
            "length": self.length, "batch": self.batch, "seed": self.seed, "layers": self.layer_names,
            "scores": {r: [[None if v != v else round(v, 6) for v in row] for row in s.tolist()] for r, s in self.scores.items()},
        }  # fmt: skip


def repeated_random_tokens(vocab_size: int, length: int, batch: int, seed: int = 0) -> torch.Tensor:
    """[batch, 2·length] int64: ``batch`` seeded random sequences of ``length`` ids, each twice."""
    vocab_size, length, batch = (positive_int(n, v) for n, v in (("vocab_size", vocab_size), ("length", length), ("batch", batch)))
    if length < 2:
        raise ValueError(f"length must be at least 2 (a previous token and a repeat), got length={length}")
    g = torch.Generator().manual_seed(seed)
    first = torch.randint(vocab_size, (batch, length), generator=g)
    return torch.cat([first, first], dim=1)


def _role_rows(weights: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """weights [B, H, 2n, 2n] -> role -> [H] mean over the rows and the batch."""
    T = weights.shape[-1]
    i = torch.arange(1, T)
    second = torch.arange(n, T)
    picks = {
        "previous_token": (i, i - 1),
        "duplicate_token": (second, second - n),
        "induction": (second, second - n + 1),
    }
    return {role: weights[:, :, q, k].mean(dim=(0, 2)) for role, (q, k) in picks.items()}


@torch.no_grad()
def causal_head_scores(
    model: nn.Module,
    *,
    vocab_size: int,
    length: int = 32,
    batch: int = 8,
    seed: int = 0,
    tokens: torch.Tensor | None = None,
) -> CausalScores:
    """Score every head of a causal multihead model on repeated random tokens.

    Args:
        model: a module whose forward takes [B, T] token ids (``models.GPT``)
            and contains multihead attention modules; run in eval mode.
        vocab_size: ids are drawn from [0, vocab_size).
        length: n, each sequence's length before its repeat (T = 2n, which
            must fit the model's context).
        batch: the number of sequences.
        seed: the generator's seed.
        tokens: [B, 2n] ids to use instead of drawing them (each row's second
            half must equal its first).

    Returns:
        a ``CausalScores`` with each role's [L, H] scores.

    Raises:
        ValueError: sizes below their minimum, or tokens that do not repeat.
    """
    if tokens is None:
        tokens = repeated_random_tokens(vocab_size, length, batch, seed)
    elif tokens.ndim != 2 or tokens.shape[1] % 2 or not torch.equal(tokens[:, : tokens.shape[1] // 2], tokens[:, tokens.shape[1] // 2 :]):
        raise ValueError(f"tokens must be [B, 2n] with each row's second half equal to its first; got shape {tuple(tokens.shape)}")
    n = tokens.shape[1] // 2
    device = next(model.parameters()).device
    with eval_mode(model), capture(model) as record:
        model(tokens.to(device))
    per_layer = [_role_rows(entry.weights.float(), n) for entry in record.layers]
    width = max(entry.weights.shape[1] for entry in record.layers)
    scores = {}
    for role in CAUSAL_ROLES:
        table = torch.full((len(per_layer), width), float("nan"))
        for li, rows in enumerate(per_layer):
            table[li, : rows[role].numel()] = rows[role]
        scores[role] = table
    return CausalScores(scores, [entry.name for entry in record.layers], n, tokens.shape[0], seed)
