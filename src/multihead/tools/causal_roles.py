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
                                                          earlier occurrence,
                                                          Wang et al. 2022)
    induction        A[i, i-n+1]  for i in n .. 2n-1    (the token after it:
                                                          prefix matching,
                                                          Olsson et al. 2022)

A head that spreads its weight evenly over the i + 1 keys it sees has the
chance level mean(1/(i+1)) over the role's rows (``CausalScores.chance``:
about (ln(2n) - 0.42)/(2n) for previous_token, ln(2)/n for the other two;
0.059 and 0.021 at n = 32), so a score well above that is the head's choice. Random
tokens carry no meaning, so a head that attends to a token's successor here
does so by the induction mechanism, not by what it knows of language. Signed
weights (DCMHA, talking heads, differential attention) are read as they are:
a negative weight lowers the score, and a score may leave [0, 1].

    copying          Σλ/Σ|λ| of the head's OV circuit   (Elhage et al. 2021;
                     W_U N_f W_O^h W_V^h N_l W_E^T       chance 0, range
                                                         [-1, 1]; ``copying``)

The copying score needs the model's token embedding and unembedding; where
the layout does not give them (``tools.copying``) it is absent: NaN for the
layers it cannot read, and no "copying" entry at all when no layer has it,
with the reasons in ``CausalScores.notes``.

The ids are drawn from [0, vocab_size) without ``exclude`` (the ids a
tokenizer marks special: ``special_token_ids``). A Hugging Face model runs
through ``multihead.hf`` (``attn_implementation="multihead"``) and is
captured by ``multihead.hf.capture``. 2n must fit the model's context
(``context_length``, ``n_positions`` or ``max_position_embeddings`` of its
config) and ``vocab_size`` its vocabulary.

``ROLE_THRESHOLDS`` are the scores from which a head is said to have a role
(what ``multihead inspect`` lists): an induction head of a trained model
puts most of its weight on the token after the earlier occurrence, far
above chance (Olsson et al. 2022 use the same prefix-matching score).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .._checks import positive_int
from .capture import capture
from .copying import copying_scores
from .heads import eval_mode

__all__ = [
    "CAUSAL_ROLES", "ROLE_THRESHOLDS", "ROLE_MEANINGS", "CausalScores", "repeated_random_tokens",
    "special_token_ids", "causal_head_scores",
]  # fmt: skip

#: The roles read from the weights, in the order tables show them.
CAUSAL_ROLES = ("previous_token", "duplicate_token", "induction")
#: A head has the role when its score reaches this (``CausalScores.heads``); copying is the OV circuit's.
ROLE_THRESHOLDS = {"induction": 0.4, "previous_token": 0.4, "duplicate_token": 0.4, "copying": 0.5}
#: What each score measures, in one line (tables and pages).
ROLE_MEANINGS = {
    "induction": "mean weight on the token after the current token's earlier occurrence (A[i, i-n+1], second half)",
    "previous_token": "mean weight on the previous position (A[i, i-1])",
    "duplicate_token": "mean weight on the current token's earlier occurrence (A[i, i-n], second half)",
    "copying": "sum of the eigenvalues of the head's OV circuit over the sum of their sizes: 1 copies, 0 chance",
}


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
        chance: role -> the score of a head that spreads its weight evenly
            over the keys it sees (0 for copying).
        notes: why a score is absent where it is (copying of a layout or a
            kind it cannot read).
    """

    scores: dict[str, torch.Tensor]
    layer_names: list[str]
    length: int
    batch: int
    seed: int
    chance: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def heads(self, role: str, threshold: float) -> list[tuple[int, int]]:
        """The (layer, head) pairs whose ``role`` score is at least ``threshold``, best first."""
        if role not in self.scores:
            raise ValueError(f"unknown role {role!r}; the scored roles are {sorted(self.scores)}")
        s = self.scores[role]
        found = [(float(s[i, j]), i, j) for i in range(s.shape[0]) for j in range(s.shape[1]) if s[i, j] >= threshold]
        return [(i, j) for _, i, j in sorted(found, key=lambda x: -x[0])]

    def to_dict(self) -> dict:
        """JSON-ready: role -> L lists of H floats (None where a layer lacks the head or the score is absent),
        with each role's chance level and threshold and the notes."""
        return {
            "length": self.length, "batch": self.batch, "seed": self.seed, "layers": self.layer_names,
            "scores": {r: [[None if v != v else round(v, 6) for v in row] for row in s.tolist()] for r, s in self.scores.items()},
            "chance": {r: round(v, 6) for r, v in self.chance.items()},
            "thresholds": {r: ROLE_THRESHOLDS[r] for r in self.scores if r in ROLE_THRESHOLDS},
            "notes": list(self.notes),
        }  # fmt: skip


def repeated_random_tokens(
    vocab_size: int, length: int, batch: int, seed: int = 0, exclude: Sequence[int] = ()
) -> torch.Tensor:
    """[batch, 2·length] int64: ``batch`` seeded random sequences of ``length`` ids from
    [0, vocab_size) without ``exclude``, each twice."""
    allowed = _allowed(vocab_size, exclude)
    length, batch = (positive_int(n, v) for n, v in (("length", length), ("batch", batch)))
    if length < 2:
        raise ValueError(f"length must be at least 2 (a previous token and a repeat), got length={length}")
    g = torch.Generator().manual_seed(seed)
    first = allowed[torch.randint(len(allowed), (batch, length), generator=g)]
    return torch.cat([first, first], dim=1)


def _allowed(vocab_size: int, exclude: Sequence[int]) -> torch.Tensor:
    """[V'] the ids of [0, vocab_size) not in ``exclude``, ascending."""
    vocab_size = positive_int("vocab_size", vocab_size)
    keep = torch.ones(vocab_size, dtype=torch.bool)
    keep[[i for i in exclude if 0 <= i < vocab_size]] = False
    if int(keep.sum()) < 2:
        raise ValueError(
            f"at least 2 ids must remain to draw from; vocab_size={vocab_size} excluding {len(exclude)} ids leaves {int(keep.sum())}"
        )
    return keep.nonzero().flatten()


def special_token_ids(tokenizer) -> list[int]:
    """The ids a tokenizer marks special (a ``tokenizers.Tokenizer``, or an object holding one as
    ``_tokenizer``, such as ``train.tokenizer.BPETokenizer``); [] for one that marks none."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    added = getattr(inner, "get_added_tokens_decoder", None)
    if added is None:
        return []
    return sorted(i for i, token in added().items() if getattr(token, "special", False))


def _chance(n: int) -> dict[str, float]:
    """Each role's score under an even spread over the i + 1 visible keys of its rows."""
    even = lambda rows: sum(1 / (i + 1) for i in rows) / len(rows)  # noqa: E731
    return {"previous_token": even(range(1, 2 * n)), "duplicate_token": even(range(n, 2 * n)),
            "induction": even(range(n, 2 * n)), "copying": 0.0}  # fmt: skip


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
    exclude: Sequence[int] = (),
) -> CausalScores:
    """Score every head of a causal model on repeated random tokens.

    Args:
        model: a module whose forward takes [B, T] token ids (``models.GPT``)
            and contains multihead attention modules, or a Hugging Face model
            loaded with ``attn_implementation="multihead"``; run in eval mode.
        vocab_size: ids are drawn from [0, vocab_size).
        length: n, each sequence's length before its repeat (T = 2n, which
            must fit the model's context).
        batch: the number of sequences.
        seed: the generator's seed.
        tokens: [B, 2n] ids to use instead of drawing them (each row's second
            half must equal its first).
        exclude: ids never drawn (``special_token_ids`` of the model's
            tokenizer); the copying score is read over the others too.

    Returns:
        a ``CausalScores`` with each role's [L, H] scores (and "copying"
        where the model's layout gives it).

    Raises:
        ValueError: sizes below their minimum, tokens that do not repeat,
            2n beyond the model's context, ids beyond its vocabulary, a
            model with no attention module that can be captured.
    """
    allowed = _allowed(vocab_size, exclude)
    if tokens is None:
        tokens = repeated_random_tokens(vocab_size, length, batch, seed, exclude)
    elif (
        tokens.ndim != 2
        or tokens.shape[1] % 2
        or not torch.equal(tokens[:, : tokens.shape[1] // 2], tokens[:, tokens.shape[1] // 2 :])
    ):
        raise ValueError(
            f"tokens must be [B, 2n] with each row's second half equal to its first; got shape {tuple(tokens.shape)}"
        )
    n = tokens.shape[1] // 2
    if n < 2:
        raise ValueError(f"length must be at least 2 (a previous token and a repeat), got length={n}")
    _check_fits(model, 2 * n, vocab_size if tokens.numel() == 0 else max(vocab_size, int(tokens.max()) + 1))
    device = next(model.parameters()).device
    hf = _runs_hf_bridge(model)
    if hf:
        from ..hf.scopes import capture as hf_capture

        recording = hf_capture(model)
    else:
        recording = capture(model)
    with eval_mode(model), recording as record:
        model(tokens.to(device))
    per_layer = [_role_rows(entry.weights.float(), n) for entry in record.layers]
    width = max(entry.weights.shape[1] for entry in record.layers)
    scores = {}
    for role in CAUSAL_ROLES:
        table = torch.full((len(per_layer), width), float("nan"))
        for li, rows in enumerate(per_layer):
            table[li, : rows[role].numel()] = rows[role]
        scores[role] = table
    names = [entry.name for entry in record.layers]
    copying, notes = copying_scores(model, names, width, allowed)
    if copying is not None:
        scores["copying"] = copying
    chance = {r: v for r, v in _chance(n).items() if r in scores}
    return CausalScores(scores, names, n, tokens.shape[0], seed, chance, notes)


def _runs_hf_bridge(model: nn.Module) -> bool:
    """A transformers model (its config has ``_attn_implementation``)."""
    return hasattr(getattr(model, "config", None), "_attn_implementation")


def _check_fits(model: nn.Module, T: int, ids: int) -> None:
    """Refuse T = 2n beyond the model's context and ids beyond its vocabulary (when its config says them)."""
    config = getattr(model, "config", None)
    for name in ("context_length", "n_positions", "max_position_embeddings"):
        limit = getattr(config, name, None)
        if isinstance(limit, int) and T > limit:
            raise ValueError(
                f"T = 2·length = {T} tokens do not fit the model's context of {limit} ({name}): "
                f"give length <= {limit // 2}"
            )
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and ids > vocab:
        raise ValueError(f"ids up to {ids - 1} do not fit the model's vocab_size {vocab}: give vocab_size <= {vocab}")
