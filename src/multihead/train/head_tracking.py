"""``--track-heads``: every head's causal-role scores at each evaluation of a run.

At every evaluation (``eval_every`` steps and the last) the model is scored
with ``tools.causal_head_scores`` on the same repeated random tokens each
time, so the points of one run (and of runs with the same vocabulary and
context) are comparable::

    tokens  r1 .. rn r1 .. rn      n = min(TRACK_LENGTH, context_length // 2)
                                   TRACK_BATCH sequences, drawn with TRACK_SEED
                                   from the ids that occur in the training split

and the scores go into that step's line of ``metrics.jsonl`` as
``"heads"``: ``CausalScores.to_dict()`` (role -> L lists of H floats) and
``"vocabulary"``, the number of ids the tokens were drawn from::

    {"step": 400, ..., "val_loss": 1.95,
     "heads": {"length": 32, "batch": 8, "seed": 0, "layers": ["blocks.0.attn", ...],
               "scores": {"previous_token": [[0.91, 0.02, ...], ...], "induction": [...], ...}}}

Scoring runs the model once in eval mode on [TRACK_BATCH, 2n] tokens with
its own generator, so it draws nothing from the training generators and a
run with tracking computes exactly the steps of one without (which is why
``track_heads`` may change on resume).

The roles are causal: a head that reads later tokens would score what it
was never meant to. ``check_trackable`` refuses a model whose attention
lets a token see a later one, before anything is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import UsageError
from ..models.gpt import GPT, GPTConfig
from ..tools.capture import capture
from ..tools.causal_roles import causal_head_scores

__all__ = [
    "TRACK_LENGTH", "TRACK_BATCH", "TRACK_SEED", "track_length", "seen_ids", "unseen_ids_of_run", "tracked_heads",
    "check_trackable",
]  # fmt: skip

TRACK_LENGTH = 32  # n, the random sequence before its repeat (capped by the context)
TRACK_BATCH = 8  # sequences per scoring
TRACK_SEED = 0  # the same tokens at every evaluation


def track_length(context_length: int) -> int:
    """n for a run at ``context_length`` (the 2n tokens must fit it)."""
    return min(TRACK_LENGTH, context_length // 2)


def seen_ids(train_tokens: np.ndarray, vocab_size: int) -> torch.Tensor:
    """[V'] int64: the ids that occur in the training tokens, ascending (the ones the model learnt;
    every id when fewer than 2 occur)."""
    counts = np.bincount(np.asarray(train_tokens, dtype=np.int64), minlength=vocab_size)
    seen = np.flatnonzero(counts)
    return torch.from_numpy(seen if len(seen) >= 2 else np.arange(vocab_size)).long()


def unseen_ids_of_run(run_dir, vocab_size: int) -> list[int]:
    """The ids that never occur in a ``multihead train`` run's training split (``data/train.bin``),
    so a scorer leaves them out as ``--track-heads`` does; [] when the run keeps no token file."""
    from pathlib import Path

    from .batches import read_tokens

    path = Path(run_dir) / "data" / "train.bin"
    if not path.is_file():
        return []
    seen = set(seen_ids(read_tokens(path), vocab_size).tolist())
    return [i for i in range(vocab_size) if i not in seen]


def tracked_heads(model: GPT, vocabulary: torch.Tensor | None, context_length: int, *,
                  sharded: bool = False) -> dict[str, Any]:  # fmt: skip
    """``{"heads": scores}`` of ``model`` (see the module docstring), or ``{}`` when ``vocabulary`` is None.

    Args:
        vocabulary: [V'] the ids the random tokens are drawn from
            (``seen_ids``: the bytes a Shakespeare run never sees keep their
            untrained embeddings, which says nothing of its heads).

        sharded: ``model`` is sharded with FSDP2: its full weights are
            gathered into a plain copy first (collective, as for a
            checkpoint; the copying score reads the weights themselves).

    The model's training flags are restored afterwards.
    """
    if vocabulary is None:
        return {}
    if sharded:
        from .shard import unsharded_copy

        model = unsharded_copy(model, next(model.parameters()).device)
    V = model.config.vocab_size
    unseen = torch.ones(V, dtype=torch.bool)
    unseen[vocabulary] = False  # drawn from, and the copying circuit read over, the ids of ``vocabulary``
    scores = causal_head_scores(model, vocab_size=V, length=track_length(context_length), batch=TRACK_BATCH,
                                seed=TRACK_SEED, exclude=unseen.nonzero().flatten().tolist())  # fmt: skip
    return {"heads": {**scores.to_dict(), "vocabulary": len(vocabulary)}}


def check_trackable(config: GPTConfig) -> None:
    """Refuse ``--track-heads`` for a model whose attention is not causal or cannot be captured.

    A one-block copy of the model (same kind and options, fresh weights,
    on the CPU, the global generators untouched) reads 8 random tokens;
    every captured weight above the diagonal must be 0.

    Raises:
        UsageError: the attention lets a token see later tokens, or no
            multihead attention module reports its weights.
    """
    values = config.to_dict()
    values["num_layers"] = 1
    for name in ("layer_heads", "layer_kv_heads", "layer_attention_options"):
        if values.get(name):
            values[name] = values[name][:1]
    T = min(8, config.context_length)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(0)
        probe = GPT(GPTConfig.from_dict(values)).eval()
        with capture(probe) as record:
            probe(torch.randint(config.vocab_size, (1, T)))
    if not record.layers:
        raise UsageError(
            f"--track-heads: attention kind {config.attention!r} reports no attention weights to score "
            "(its module does not notify observers; see docs/adding-a-kind.md)"
        )
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    for entry in record.layers:
        seen = entry.weights[0][:, future].abs().max().item() if T > 1 else 0.0
        if seen > 1e-6:
            raise UsageError(
                f"--track-heads scores causal head roles, but attention kind {config.attention!r} lets a token "
                f"see later tokens (weight {seen:.3g} above the diagonal in {entry.name}): its heads cannot be tracked"
            )
