"""How far a model's logits are from a reference's: weight-only bf16/int8 against float32.

    err = logit_error(gpt, quantize_weights(gpt, "int8"), idx, new_tokens=32)
    print(err.line())   # max abs 3.1e-03, relative 1.2e-03, greedy 32/32 tokens equal, argmax 100.0%

The reference continues the prompt greedily by ``new_tokens``; both models
then score that whole sequence in one forward (teacher forcing) and their
logits [B, T, V] are compared at every position. Separately, ``model``
continues the prompt greedily on its own, and the new tokens equal to the
reference's before the first difference are counted (the fewest over rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .._checks import non_negative_int

__all__ = ["LogitError", "logit_error"]


@dataclass(frozen=True)
class LogitError:
    """Logit error of a model against a reference over one sequence.

    Attributes:
        max_abs: max |logits - reference logits| over rows, positions and vocabulary.
        relative: ||logits - reference||_F / ||reference||_F over the same.
        argmax_agreement: fraction of (row, position) pairs whose argmax is the reference's.
        greedy_equal: new tokens of ``model``'s own greedy continuation equal to the
            reference's before the first difference (the fewest over rows).
        new_tokens: tokens each greedy continuation added.
        positions: positions compared per row (prompt + new tokens, within the context).
    """

    max_abs: float
    relative: float
    argmax_agreement: float
    greedy_equal: int
    new_tokens: int
    positions: int

    def line(self) -> str:
        """One line for a report."""
        return (
            f"max abs {self.max_abs:.2e}, relative {self.relative:.2e} over {self.positions} positions, "
            f"greedy {self.greedy_equal}/{self.new_tokens} tokens equal, argmax {100 * self.argmax_agreement:.1f}%"
        )


def logit_error(reference: nn.Module, model: nn.Module, idx: torch.Tensor, new_tokens: int = 32) -> LogitError:
    """Compare ``model``'s logits with ``reference``'s (both GPT-like, in eval mode).

    Args:
        reference: the model taken as exact (e.g. the float32 GPT).
        model: the model measured (e.g. ``quantize_weights(reference, "int8")``).
        idx: [B, T0] prompt ids (no padding).
        new_tokens: greedy tokens added by each model (0: the prompt only).

    Returns:
        a :class:`LogitError`.

    Raises:
        TypeError / ValueError: as ``generate`` for the prompt; models of
            different vocabularies.
    """
    new_tokens = non_negative_int("new_tokens", new_tokens)
    if reference.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the models have different vocabularies: {reference.config.vocab_size} and {model.config.vocab_size}"
        )
    with torch.no_grad():
        want = reference.generate(idx, new_tokens, temperature=0)  # (B, T0 + n)
        got = model.generate(idx, new_tokens, temperature=0)
        window = want[:, -reference.config.context_length :]
        ref = reference(window).float()  # (B, T, V)
        out = model(window).float()
    T0 = idx.shape[1]
    diff = out - ref
    n = want.shape[1] - T0
    same = (got[:, T0:] == want[:, T0:]).long().cumprod(dim=1).sum(dim=1)  # equal tokens before the first difference
    return LogitError(
        max_abs=float(diff.abs().max()),
        relative=float(torch.linalg.vector_norm(diff) / torch.linalg.vector_norm(ref)),
        argmax_agreement=float((out.argmax(-1) == ref.argmax(-1)).float().mean()),
        greedy_equal=int(same.min()) if n else 0,
        new_tokens=n,
        positions=window.shape[1],
    )
