"""The per-text scores of ``corpus_roles`` and their summary: mean, spread, evidence, roles.

``PerTextScores`` keeps one [texts, heads] float64 table per score (NaN where a
text did not measure it) with the rows, keys and chance of each entry;
``summarise`` turns each head's columns into ``ScoreSpread`` values and
the labels that follow ``classify_heads``' rule on the means and the
``EvidenceRule`` (the module docstring of ``corpus_roles`` states both).
The 95% interval uses ``train.compare_stats.t_quantile``, Student's t
from its closed form.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from .._checks import positive_int
from .roles import HeadRoles

__all__ = ["TOKEN_ROLES", "EvidenceRule", "ScoreSpread", "CorpusHeadRoles", "PerTextScores", "summarise"]

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


class PerTextScores:
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
    """The 97.5% quantile of Student's t; above 1000 degrees of freedom the first terms of its
    expansion in 1/df (Abramowitz and Stegun 26.7.5), within 1e-8 there."""
    if df <= 1000:
        from ..train.compare_stats import t_quantile  # here: importing multihead.train costs more than this module

        return t_quantile(_LEVEL, df)
    z = 1.959963984540054  # the normal 97.5% quantile
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


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


def summarise(scores: PerTextScores, limits: dict[str, float], margin: float, rule: EvidenceRule) -> list[CorpusHeadRoles]:
    """Each head's ``ScoreSpread`` per score and its labels: a role whose mean reaches ``limits[role]``
    and beats the mean chance by ``margin`` is given when ``rule`` holds for it, else withheld."""
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
