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

import functools
import math
import numbers
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .._checks import positive_int
from ..progress import ProgressBar
from ..train.compare_stats import t_quantile
from .capture import AttentionRecord
from .roles import ROLE_MARGIN, HeadRoles, _thresholds, classify_heads

__all__ = [
    "TOKEN_ROLES", "EvidenceRule", "ScoreSpread", "CorpusHeadRoles", "CorpusRoles", "corpus_roles",
    "score_records",
]  # fmt: skip

#: Roles about a kind of key token: their evidence also counts those keys.
TOKEN_ROLES = ("cls", "sep", "punct", "rare")
_LEVEL = 0.975  # two-sided 95%


@dataclass(frozen=True)
class EvidenceRule:
    """How much a score must have been measured on before it can give a role.

    Attributes:
        min_texts: texts that measured the score.
        min_rows: query rows it averaged, over those texts.
        min_keys: cls/sep/punct/rare only: key positions of that kind, over those texts.
    """

    min_texts: int = 3
    min_rows: int = 30
    min_keys: int = 3

    def __post_init__(self) -> None:
        for name in ("min_texts", "min_rows", "min_keys"):
            positive_int(name, getattr(self, name))

    def holds(self, role: str, spread: ScoreSpread) -> bool:
        """Whether ``spread`` (the score of ``role``) was measured on enough to give the role."""
        keys_ok = role not in TOKEN_ROLES or (spread.keys or 0) >= self.min_keys
        return spread.texts >= self.min_texts and spread.rows >= self.min_rows and keys_ok

    def describe(self) -> str:
        return (f"measured on >= {self.min_texts} texts and >= {self.min_rows} query rows "
                f"(cls/sep/punct/rare: and >= {self.min_keys} such key tokens)")  # fmt: skip


@dataclass
class ScoreSpread:
    """One score of one head over the corpus (see the module docstring)."""

    mean: float
    sd: float | None
    low: float | None
    high: float | None
    texts: int
    rows: int
    keys: int | None = None
    chance: float | None = None


@dataclass
class CorpusHeadRoles:
    """The roles of one head over a corpus.

    Attributes:
        layer, head, name: as ``HeadRoles``.
        labels: roles given (mean past threshold and margin, with evidence).
        stats: score name -> ``ScoreSpread``.
        withheld: roles whose mean passed but whose evidence fell short.
        texts: texts that measured the head at all.
        enough: score name -> whether its evidence suffices (roles only).
    """

    layer: int
    head: int
    name: str
    labels: list[str]
    stats: dict[str, ScoreSpread]
    withheld: list[str] = field(default_factory=list)
    texts: int = 0
    enough: dict[str, bool] = field(default_factory=dict)

    @property
    def scores(self) -> dict[str, float]:
        """score name -> mean over the texts."""
        return {name: s.mean for name, s in self.stats.items()}

    def to_dict(self) -> dict:
        """The role mapping ``visualize`` draws (means as ``scores``) with the spread and evidence."""
        stats = self.stats.items()
        return {
            "layer": self.layer, "head": self.head, "labels": list(self.labels), "scores": self.scores,
            "chance": {n: s.chance for n, s in stats if s.chance is not None},
            "spread": {n: s.sd for n, s in stats if s.sd is not None},
            "interval": {n: [s.low, s.high] for n, s in stats if s.low is not None},
            "evidence": {n: {"texts": s.texts, "rows": s.rows, "keys": s.keys, "enough": self.enough.get(n)}
                         for n, s in stats},
            "texts": self.texts, "withheld": list(self.withheld),
        }  # fmt: skip


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


class _Scores:
    """Per-text scores of every head, kept as rows of a [texts, heads] table per score."""

    def __init__(self, n_texts: int) -> None:
        self.n = n_texts
        self.heads: list[tuple[int, int, str]] | None = None
        self.values: dict[str, torch.Tensor] = {}
        self.rows: dict[str, torch.Tensor] = {}
        self.keys: dict[str, torch.Tensor] = {}
        self.chance: dict[str, torch.Tensor] = {}

    def _column(self, table: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        if name not in table:
            table[name] = torch.full((self.n, len(self.heads)), math.nan, dtype=torch.float64)
        return table[name]

    def add(self, index: int, roles: list[HeadRoles]) -> None:
        heads = [(r.layer, r.head, r.name) for r in roles]
        if self.heads is None:
            self.heads = heads
        elif heads != self.heads:
            raise ValueError(f"text {index} was recorded with other layers or heads than the first text: "
                             f"{len(heads)} heads against {len(self.heads)}; capture every text with the same model")  # fmt: skip
        for j, r in enumerate(roles):
            scores = dict(r.scores)
            if r.entropy is not None:
                scores["entropy"] = r.entropy
            if r.mean_distance is not None:
                scores["distance"] = r.mean_distance
            for name, value in scores.items():
                self._column(self.values, name)[index, j] = value
                used = r.rows.get(name, r.rows.get("broad", 0))  # entropy, distance: broad's rows
                self._column(self.rows, name)[index, j] = used
                if name in r.keys:
                    self._column(self.keys, name)[index, j] = r.keys[name]
                if name in r.chance:
                    self._column(self.chance, name)[index, j] = r.chance[name]


@functools.lru_cache(maxsize=64)
def _t(df: int) -> float:
    """The 97.5% quantile of Student's t; above 1000 degrees of freedom its expansion
    z + (z^3 + z) / (4 df), which is within 1e-6 there."""
    if df <= 1000:
        return t_quantile(_LEVEL, df)
    z = 1.959963984540054
    return z + (z**3 + z) / (4 * df)


def _spread(x: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor | None, chance: torch.Tensor | None) -> ScoreSpread | None:
    """ScoreSpread of one head's per-text column ``x`` [texts] (NaN: not measured)."""
    seen = ~torch.isnan(x)
    n = int(seen.sum())
    if n == 0:
        return None
    v = x[seen]
    mean = float(v.mean())
    sd = low = high = None
    if n > 1:
        sd = float(v.std(correction=1))
        half = _t(n - 1) * sd / math.sqrt(n)
        low, high = mean - half, mean + half
    k = None if keys is None else int(keys[seen].nan_to_num(0.0).sum())
    c = None if chance is None or bool(torch.isnan(chance[seen]).all()) else float(chance[seen].nanmean())
    return ScoreSpread(mean, sd, low, high, n, int(rows[seen].sum()), k, c)


def _summarise(scores: _Scores, limits: dict[str, float], margin: float, rule: EvidenceRule) -> list[CorpusHeadRoles]:
    out = []
    for j, (layer, head, name) in enumerate(scores.heads or []):
        stats: dict[str, ScoreSpread] = {}
        for score, table in scores.values.items():
            keys, chance = scores.keys.get(score), scores.chance.get(score)
            found = _spread(table[:, j], scores.rows[score][:, j], None if keys is None else keys[:, j],
                            None if chance is None else chance[:, j])  # fmt: skip
            if found is not None:
                stats[score] = found
        labels, withheld, enough = [], [], {}
        for role, limit in limits.items():
            s = stats.get(role)
            if s is None:
                continue
            enough[role] = rule.holds(role, s)
            if s.mean >= limit and (s.chance is None or s.mean - s.chance >= margin):
                (labels if enough[role] else withheld).append(role)
        texts = stats["broad"].texts if "broad" in stats else 0
        out.append(CorpusHeadRoles(layer, head, name, labels, stats, withheld, texts, enough))
    return out


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
    scores = _Scores(len(items))
    for index, one in enumerate(items):
        scores.add(index, _score_item(one, freqs, None, limits, margin, rare_k))
    return CorpusRoles(_summarise(scores, limits, margin, evidence), len(items), sum(map(len, keys)), freqs,
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
    from .corpus_inputs import encode_texts, model_limit, model_runner, run_batch

    limits, margin, evidence = _check_rule(thresholds, margin, evidence)
    batch_size = positive_int("batch_size", batch_size)
    runner = model_runner(model, layers)
    if tokenizer is None:
        tokenizer = getattr(model, "tokenizer", None)
    encoded = encode_texts(texts, tokenizer, max_length=max_length or model_limit(model), truncate=truncate)
    freqs = _frequencies([tokens for _, tokens in encoded], token_frequencies)
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][0]))  # similar lengths share a batch
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    scores = _Scores(len(encoded))
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
    return CorpusRoles(_summarise(scores, limits, margin, evidence), len(encoded),
                       sum(len(ids) for ids, _ in encoded), freqs, scores.values, limits, margin, evidence)  # fmt: skip
