"""Head roles over a corpus: every head scored on every text, with the spread over texts.

    found = corpus_roles(load_minilm(), texts, batch_size=16)
    print(format_corpus_roles(found))
    s = found.heads[0].stats["cls"]        # ScoreSpread of layer 0, head 0
    s.mean, s.sd, s.low, s.high, s.texts, s.rows, s.keys

``corpus_roles`` runs the model over the texts a batch at a time (texts of
similar length together, padded on the right; the padding is left out of
every score), captures the batch's weights, scores each text with
``roles.classify_heads`` and keeps only the per-text scores: memory holds one
batch's weights and a [texts, heads] table per score. ``score_records`` does
the same on AttentionRecords you captured yourself (one text each, or a
padded batch with one token list per item and its ``attention_mask``).

For each head and score (``classify_heads``' names, plus ``entropy`` and
``distance``), over the texts where the score was measurable::

    mean   the average of the per-text scores (each text counts once)
    sd     their sample standard deviation (n - 1; None with one text)
    low, high   the 95% Student t interval of the mean, mean +- t sd / sqrt(n)
    texts  the texts that measured it; rows: the query rows those texts averaged
    keys   cls/sep/punct/rare: the key positions of that kind in those texts
    chance the mean of the per-text chance levels (``HeadRoles.chance``)

The rare score reads the corpus's token frequencies (every token of every
text counted; ``token_frequencies`` replaces them): each text's rare word is
its word that is rarest in the corpus, not in the text, so a text that
repeats its words still has one, and a word that a text uses once but the
corpus uses everywhere is not rare.

A head gets a role when the *mean* reaches the role's threshold and beats the
mean chance by the margin (``classify_heads``' rule) **and** the score has the
evidence of ``EvidenceRule``: measured on at least ``min_texts`` texts and
``min_rows`` query rows in total and, for a role about a kind of token
(cls, sep, punct, rare), at least ``min_keys`` such key positions in total.
A role that passes the threshold without that evidence is listed in
``withheld`` instead. Each measured text holds at least one key of the kind,
so the default ``min_keys`` matters once ``min_texts`` is lowered: a role is
never given from a single token.

Progress: one unit per batch on stderr (``multihead.progress``: a bar on a
terminal, plain lines in a log).
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .._checks import positive_int
from ..progress import ProgressBar
from .capture import AttentionRecord
from .corpus_stats import CorpusHeadRoles, EvidenceRule, PerTextScores, summarise
from .roles import ROLE_MARGIN, HeadRoles, _thresholds, classify_heads

__all__ = ["CorpusRoles", "corpus_roles", "score_records"]


@dataclass
class CorpusRoles:
    """What ``corpus_roles`` found.

    Attributes:
        heads: one ``CorpusHeadRoles`` per recorded call and head, in record order.
        texts: texts scored.
        tokens: their tokens (special tokens included).
        token_frequencies: token -> count, what the rare score read.
        values: score name -> [texts, heads] float64 per-text scores (NaN: not measured),
            texts in the order given, heads in ``heads`` order.
        thresholds, margin, evidence: the rule the labels followed.
    """

    heads: list[CorpusHeadRoles]
    texts: int
    tokens: int
    token_frequencies: dict[str, float]
    values: dict[str, torch.Tensor]
    thresholds: dict[str, float]
    margin: float
    evidence: EvidenceRule


def _frequencies(token_lists: Sequence[Sequence[str]], given: Mapping[str, float] | None) -> dict[str, float]:
    if given is not None:
        if not isinstance(given, Mapping):
            raise TypeError(f"token_frequencies must be a dict of token -> count, got {type(given).__name__}")
        return dict(given)
    counts: Counter = Counter()
    for tokens in token_lists:
        counts.update(tokens)
    return dict(counts)


def _visible(record: AttentionRecord) -> torch.Tensor:
    """[T, S] bool for a one-item record: causal (lower triangle) when every head of every call
    gives exactly zero weight above the diagonal, else every key."""
    T, S = record.layers[0].weights.shape[-2:]
    full = torch.ones(T, S, dtype=torch.bool)
    if T != S:
        return full
    above = full.triu(1)
    causal = all(bool((e.weights[..., above] == 0).all()) for e in record.layers)
    return full.tril() if causal else full


def _check_rule(thresholds, margin, evidence) -> tuple[dict[str, float], float, EvidenceRule]:
    limits = _thresholds(thresholds)
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not math.isfinite(margin):
        raise TypeError(f"margin must be a finite number, got {margin!r}")
    if evidence is None:
        evidence = EvidenceRule()
    if not isinstance(evidence, EvidenceRule):
        raise TypeError(f"evidence must be an EvidenceRule, got {type(evidence).__name__}")
    return limits, float(margin), evidence


def _score_item(one: AttentionRecord, freqs, ids, limits, margin, rare_k) -> list[HeadRoles]:
    return classify_heads(one, thresholds=limits, margin=margin, token_frequencies=freqs, token_ids=ids,
                          rare_k=rare_k, mask=_visible(one), links=1)  # fmt: skip


def _items(record: AttentionRecord, i: int) -> list[AttentionRecord]:
    if not isinstance(record, AttentionRecord):
        raise TypeError(f"records[{i}] must be an AttentionRecord, got {type(record).__name__}")
    if not record.layers:
        raise ValueError(f"records[{i}] is empty (no layers): run the model inside `with capture(model)`")
    record.require_whole("corpus roles")
    items = [record.item(b) for b in range(record.layers[0].weights.shape[0])]
    for b, one in enumerate(items):
        if one.query_tokens is None:
            raise ValueError(f"records[{i}] item {b} has no query_tokens: roles over a corpus need each text's tokens")
    return items


def score_records(
    records: Sequence[AttentionRecord],
    *,
    token_frequencies: Mapping[str, float] | None = None,
    thresholds: Mapping[str, float] | None = None,
    margin: float = ROLE_MARGIN,
    evidence: EvidenceRule | None = None,
    rare_k: int = 1,
) -> CorpusRoles:
    """``corpus_roles`` on records you captured: every batch item of every record is one text.

    Each record holds whole heads and rows with ``query_tokens`` (one list per
    item for a padded batch, with its ``attention_mask``). Frequencies for the
    rare score: ``token_frequencies``, else the counts of every item's tokens.

    Raises:
        TypeError: a record that is not an AttentionRecord, a bad threshold,
            margin or evidence.
        ValueError: an empty record or one without tokens, records of other
            layers or heads than the first.
    """
    limits, margin, evidence = _check_rule(thresholds, margin, evidence)
    if isinstance(records, AttentionRecord) or not isinstance(records, Sequence):
        raise TypeError(f"records must be a list of AttentionRecords, got {type(records).__name__}")
    items = [one for i, record in enumerate(records) for one in _items(record, i)]
    if not items:
        raise ValueError("records is empty: give at least one captured text")
    keys = [one.key_tokens if one.key_tokens is not None else one.query_tokens for one in items]
    freqs = _frequencies(keys, token_frequencies)
    scores = PerTextScores(len(items))
    for index, one in enumerate(items):
        scores.add(index, _score_item(one, freqs, None, limits, margin, rare_k))
    return CorpusRoles(summarise(scores, limits, margin, evidence), len(items), sum(map(len, keys)), freqs,
                       scores.values, limits, margin, evidence)  # fmt: skip


def corpus_roles(
    model,
    texts: Sequence,
    *,
    tokenizer=None,
    batch_size: int = 8,
    max_length: int | None = None,
    truncate: bool = False,
    layers: Sequence[int] | None = None,
    token_frequencies: Mapping[str, float] | None = None,
    thresholds: Mapping[str, float] | None = None,
    margin: float = ROLE_MARGIN,
    evidence: EvidenceRule | None = None,
    rare_k: int = 1,
    progress: bool = True,
    desc: str = "corpus",
) -> CorpusRoles:
    """Score every head on every text and summarise each score over the texts (module docstring).

    Args:
        model: a sentence encoder (``load_minilm()``), a module with multihead
            attention (a GPT, a BertEncoder) or a transformers model running
            ``attn_implementation="multihead"`` (``tools.corpus_inputs``).
        texts: strings, or ``(ids, tokens)`` pairs already encoded.
        tokenizer: a ``tokenizers.Tokenizer`` for string texts; default the
            model's own (a sentence encoder's), else UTF-8 bytes.
        batch_size: texts per forward pass (texts of similar length together).
        max_length: the longest text; default the model's maximum.
        truncate: cut a longer text to its first tokens instead of refusing it.
        layers: only these attention calls (layer numbers from 0).
        token_frequencies: token -> frequency for the rare score; default the
            corpus's own counts.
        thresholds, margin, rare_k: as ``classify_heads``.
        evidence: the ``EvidenceRule`` a role needs (default ``EvidenceRule()``).
        progress: one unit per batch on stderr.
        desc: the progress display's name.

    Raises:
        TypeError / ValueError: as ``encode_texts``, ``score_records``; a
            batch_size that is not a positive int; a layer out of range.
    """
    from .corpus_inputs import encode_texts, model_limit, model_runner, model_vocab, run_batch

    limits, margin, evidence = _check_rule(thresholds, margin, evidence)
    batch_size = positive_int("batch_size", batch_size)
    runner = model_runner(model, layers)
    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    encoded = encode_texts(texts, tokenizer, max_length=max_length or model_limit(model), truncate=truncate,
                           vocab_size=model_vocab(model))  # fmt: skip
    freqs = _frequencies([tokens for _, tokens in encoded], token_frequencies)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))  # similar lengths share a batch
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    scores = PerTextScores(len(encoded))
    bar = ProgressBar(len(batches), desc=desc, unit="batch", enabled=progress)
    try:
        for batch in batches:
            record = run_batch(runner, [encoded[i] for i in batch], layers)
            for b, index in enumerate(batch):
                roles = _score_item(record.item(b), freqs, encoded[index][0], limits, margin, rare_k)
                scores.add(index, roles)
            bar.update(note=f"{len(batch)} texts")
    finally:
        bar.close()
    return CorpusRoles(summarise(scores, limits, margin, evidence), len(encoded),
                       sum(len(ids) for ids, _ in encoded), freqs, scores.values, limits, margin, evidence)  # fmt: skip
