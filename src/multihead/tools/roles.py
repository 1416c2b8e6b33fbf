"""What each head does: positional, special-token, broad and rare-token heads.

    with capture(model) as record:
        model(input_ids)
    record.query_tokens = tokens
    print(format_roles(classify_heads(record)))

Each head of each recorded call gets scores (the ``_score_*`` functions cite
the paper behind each) and the role labels whose score reaches
``ROLE_THRESHOLDS`` (or your overrides) *and* beats chance by ``ROLE_MARGIN``.
Chance is the score of a head that spreads its weight evenly over the keys
each query sees: 0 for previous/next/self (an even row has no strict
largest weight), the share of visible keys of that kind for cls/sep/punct/
rare (``HeadRoles.chance``). So a text made mostly of one word, where an even
head already puts most of its weight on it, gives no rare (or punct) role.
broad needs only its threshold (an even head is the broadest one).

Rows used: a row counts when its weights are not all zero and its query sees
at least two keys (query 0 of a causal model made no choice). Rows are
divided by their sum (a no-op after softmax). A key is *visible* where
``mask`` allows it or, without a mask, where any head of the same call gives
it non-zero weight (masks hide the same keys from every head).

Signed weights: DCMHA and talking-heads attention mix heads after the
softmax, so a row may hold negative entries (and still sum to 1). Every
score reads the magnitudes: each used row is replaced by ``|w| / sum(|w|)``
(a no-op for softmax rows), so masses stay in [0, 1], the normalised
entropy in [0, 1], positional scores compare ``|w|`` and distances stay
within [0, max |i - j|]. A row counts when some ``|w|`` is non-zero;
``strongest_links`` ranks by ``|w|`` and reports the signed weight.
Non-finite weights are refused. Scores about
a set of keys average over the rows that can see one of them::

    causal, T = S = 4     previous-token score uses rows 1..3
    q0  x . . .           (skipped: one visible key)
    q1  x x . .           neighbour key 0 visible
    q2  x x x .           neighbour key 1 visible

Positional scores and distances need T == S (self-attention) and are left
out otherwise. Token scores need ``record.query_tokens``/``key_tokens``
(which describe batch item 0). A score that cannot be measured (no tokens,
no [SEP] in the input, T != S) is absent from ``scores`` and never a label.
Without ``token_frequencies`` the rare score needs two different words in
the text: with one (a text that repeats a word) no word is rarer than another.

Each role's score, its threshold, and the table and legend that print its
definition stay in this file, so a formula and its printed meaning cannot
drift apart. Which tokens are special, punctuation or rare is
``token_kinds``; a head's strongest links are ``head_links``.
"""

from __future__ import annotations

import math
import numbers
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .._checks import non_negative_int, positive_int
from .capture import AttentionRecord
from .head_links import Link, strongest_links
from .token_kinds import CLS_TOKENS, SEP_TOKENS, is_punctuation, rare_tokens

__all__ = [
    "ROLE_THRESHOLDS", "ROLE_MARGIN", "HeadRoles", "classify_heads", "role_table", "format_roles", "SCORE_MEANINGS",
    "role_legend", "format_legend", "NO_ROLE", "RULE", "MARKS",
]  # fmt: skip

#: Default thresholds; a head gets a role when its score is >= the number.
#: previous/next 0.9: Voita et al. 2019, "Positional heads" (largest weight on one relative
#: position for at least 90% of tokens); self 0.9: that rule at offset 0 (ours).
#: cls/sep/punct 0.5: the majority of the attention; Clark et al. 2019 ("Attending to
#: separator tokens") find over half of BERT's layer 6-10 attention on [SEP].
#: broad 0.8 of the largest possible entropy: our choice (Clark et al. describe
#: broad heads without a number). rare 0.5: majority rule, our choice (Voita et
#: al., "Rare words", describe the rare-token head without a number).
ROLE_THRESHOLDS: dict[str, float] = {
    "previous": 0.9, "next": 0.9, "self": 0.9, "cls": 0.5, "sep": 0.5, "punct": 0.5, "broad": 0.8, "rare": 0.5,
}  # fmt: skip

#: How far a score must beat chance (the score of an even head, see the module
#: docstring) for a role, besides reaching its threshold; our choice: a quarter
#: of the whole range, so "most of the weight" means more than an even head gives.
ROLE_MARGIN = 0.25



@dataclass
class HeadRoles:
    """The scores and role labels of one head in one recorded call.

    Attributes:
        layer: ``LayerAttention.layer`` of the call.
        head: head index.
        scores: score name -> value; see ``classify_heads`` for the names.
        labels: the roles whose score reached its threshold and beat chance
            by the margin, in ``ROLE_THRESHOLDS`` order.
        mean_distance: average attention distance in positions (None when
            T != S or no row was usable).
        entropy: mean row entropy in nats (None when no row was usable).
        links: the strongest links (``strongest_links``).
        name: the attention module's path inside the model.
        chance: role -> the score an even head would get on this input
            (previous/next/self 0; cls/sep/punct/rare the share of such keys).
        rows: score name -> the query rows it averaged (its evidence; the
            ``*_mass`` scores share their role's rows, entropy and distance
            are broad's).
        keys: cls/sep/punct/rare -> the key positions of that kind in the text.
    """

    layer: int
    head: int
    scores: dict[str, float]
    labels: list[str]
    mean_distance: float | None
    entropy: float | None
    links: list[Link] = field(default_factory=list)
    name: str = ""
    chance: dict[str, float] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=dict)
    keys: dict[str, int] = field(default_factory=dict)


def _score_positional(
    P: torch.Tensor, vis: torch.Tensor, rows: torch.Tensor, offset: int
) -> tuple[float, float, int] | None:
    """Previous-token (offset -1), self (0) and next-token (+1) heads.

    Voita et al. 2019, "Analyzing Multi-Head Self-Attention: Specialized Heads
    Do the Heavy Lifting, the Rest Can Be Pruned" (ACL), "Positional heads": a head is
    positional when for at least 90% of tokens its largest weight goes to the
    token at a fixed relative position. Returns (fraction of rows whose
    neighbour i + offset holds the row's strictly largest weight -- a tie is
    not a win, so a uniform row scores 0 --, mean weight on the neighbour,
    rows used), over the rows whose neighbour exists and is visible; None if
    there is none.
    """
    S = P.shape[1]
    j = rows + offset
    ok = (j >= 0) & (j < S)
    ok[ok.clone()] = vis[ok, j[ok]]
    if not bool(ok.any()):
        return None
    r = ok.nonzero().squeeze(1)
    p = P[r]
    w = p[torch.arange(len(r)), j[r]]
    others = p.clone()
    others[torch.arange(len(r)), j[r]] = -1.0
    wins = w > others.max(dim=-1).values
    return float(wins.double().mean()), float(w.mean()), len(r)


def _score_mass(P: torch.Tensor, vis: torch.Tensor, keys: torch.Tensor) -> tuple[float, float, int] | None:
    """Attention mass on a kind of key ([CLS], [SEP], punctuation, rare).

    Clark et al. 2019, "What Does BERT Look At? An Analysis of BERT's
    Attention" (BlackboxNLP), "Attending to separator tokens": the weight each query puts on the keys
    of that kind, summed, averaged over the queries. We average over the rows
    that can see at least one such key, so causal rows before it do not
    count. Returns (mass, chance, rows used), chance being the mass of an even
    row: the share of its visible keys that are of the kind; None if no row can
    see one.
    """
    ok = (vis & keys).any(dim=-1)
    if not bool(ok.any()):
        return None
    share = (vis[ok] & keys).sum(dim=-1).double() / vis[ok].sum(dim=-1).double()
    return float(P[ok][:, keys].sum(dim=-1).mean()), float(share.mean()), int(ok.sum())


def _score_entropy(P: torch.Tensor, vis: torch.Tensor) -> tuple[float, float]:
    """Broad heads: (mean row entropy in nats, mean normalised entropy).

    Clark et al. 2019 ("Focused vs broad attention") measure each head by the
    average entropy of its attention rows. The normalised entropy divides
    each row's entropy by log(number of visible keys), its largest possible
    value, so a causal row that sees 3 keys is as broad as one that sees 300
    when both are uniform (1.0).
    """
    logs = torch.where(P > 0, P.log(), torch.zeros_like(P))
    ent = -(P * logs).sum(dim=-1)
    n = vis.sum(dim=-1).double()
    return float(ent.mean()), float((ent / n.log()).mean())


def _score_distance(P: torch.Tensor, rows: torch.Tensor) -> float:
    """Average attention distance: sum_j A[i, j] |i - j|, averaged over rows.

    Vig & Belinkov 2019, "Analyzing the Structure of Attention in a
    Transformer Language Model" (BlackboxNLP): their attention-distance
    analysis, where the mean grows with depth in GPT-2.
    """
    keys = torch.arange(P.shape[1], dtype=torch.float64)
    return float((P * (rows.double()[:, None] - keys[None, :]).abs()).sum(dim=-1).mean())


def _head_scores(
    A: torch.Tensor, visible: torch.Tensor, key_kinds: Mapping[str, torch.Tensor]
) -> tuple[dict[str, float], dict[str, float], float | None, float | None, dict[str, int]]:
    """Scores, chance levels, entropy, distance and rows used per score of one head ``A`` [T, S] (float64).

    Signed weights are scored by magnitude: every score sees the used rows of
    ``|A|`` divided by their sums, rows that are distributions over the keys
    (see the module docstring), which keeps each score in its range.
    """
    T, S = A.shape
    A = A.abs()  # signed (post-softmax mixed) weights: score the magnitudes
    total = A.sum(dim=-1)
    use = (total > 0) & (visible.sum(dim=-1) >= 2)
    if not bool(use.any()):
        return {}, {}, None, None, {}
    rows = use.nonzero().squeeze(1)
    P, vis = A[rows] / total[rows, None], visible[rows]
    scores: dict[str, float] = {}
    chance: dict[str, float] = {}
    used: dict[str, int] = {}
    distance = None
    if T == S:
        for name, offset in (("previous", -1), ("self", 0), ("next", 1)):
            found = _score_positional(P, vis, rows, offset)
            if found is not None:
                scores[name], scores[f"{name}_mass"], used[name] = found
                used[f"{name}_mass"] = used[name]
                chance[name] = 0.0  # an even row has no strict largest weight
        distance = _score_distance(P, rows)
    for name, keys in key_kinds.items():
        found = _score_mass(P, vis, keys)
        if found is not None:
            scores[name], chance[name], used[name] = found
    entropy, scores["broad"] = _score_entropy(P, vis)
    used["broad"] = len(rows)
    return scores, chance, entropy, distance, used


def _thresholds(overrides: Mapping[str, float] | None) -> dict[str, float]:
    merged = dict(ROLE_THRESHOLDS)
    for name, value in (overrides or {}).items():
        if name not in ROLE_THRESHOLDS:
            raise ValueError(f"unknown role {name!r} in thresholds; valid roles: {sorted(ROLE_THRESHOLDS)}")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
            raise TypeError(f"thresholds[{name!r}] must be a number, got {value!r}")
        merged[name] = float(value)
    return merged


def classify_heads(
    record: AttentionRecord,
    *,
    thresholds: Mapping[str, float] | None = None,
    token_frequencies: Mapping[str, float] | None = None,
    token_ids: Sequence[int] | None = None,
    rare_k: int = 1,
    mask: torch.Tensor | None = None,
    links: int = 3,
    batch: int = 0,
    margin: float = ROLE_MARGIN,
) -> list[HeadRoles]:
    """Scores and role labels for every head of every recorded call.

    Score names (absent when not measurable, see the module docstring):
    ``previous``/``next``/``self`` (fraction of rows whose strict argmax is
    key i-1 / i+1 / i, Voita et al. 2019) with ``*_mass`` (mean weight there);
    ``cls``/``sep``/``punct`` (mean mass on those keys, Clark et al. 2019);
    ``broad`` (mean normalised entropy, Clark et al. 2019); ``rare`` (mean
    mass on the ``rare_k`` rarest tokens, Voita et al. 2019; measured when
    ``token_frequencies`` is given or the keys hold two different words). ``entropy`` and
    ``mean_distance`` (Vig & Belinkov 2019) are fields of ``HeadRoles``.
    Negative weights (heads mixed after the softmax, as in DCMHA) are scored
    by magnitude, each row as ``|w| / sum(|w|)``: fractions and masses stay
    in [0, 1], ``broad`` in [0, 1], ``entropy`` in [0, log S].

    Args:
        record: from ``capture``; weights [B, H, T, S] per call.
        thresholds: role -> threshold, merged over ``ROLE_THRESHOLDS``; a
            head gets a label when its score is >= the threshold and
            >= chance + ``margin`` (``math.inf`` switches a role off).
        token_frequencies: token -> frequency for the rare-token score (see
            ``rare_tokens``); default: counts within the key tokens.
        token_ids: S vocabulary ids of the key tokens, to break frequency ties.
        rare_k: how many distinct rare tokens the rare score covers.
        mask: [T, S] bool, True = may attend; default: inferred per call
            from the weights (any head non-zero).
        links: how many ``strongest_links`` per head (keys that are special
            tokens skipped; positions as strings when there are no tokens).
        batch: which batch item to read (its own tokens and padding when the
            record has them, see ``AttentionRecord.item``).
        margin: how far a score must beat chance for a role (not broad's).

    Returns:
        one ``HeadRoles`` per recorded call and head, in record order.

    Raises:
        TypeError: record not an ``AttentionRecord``, a bad threshold type.
        ValueError: weights not [B, H, T, S] or not finite;
            batch out of range; token lists or mask not matching [T, S];
            an unknown role in thresholds; weight on a key the mask hides;
            a record that holds only some heads or rows.
    """
    if not isinstance(record, AttentionRecord):
        raise TypeError(f"record must be an AttentionRecord, got {type(record).__name__}")
    limits = _thresholds(thresholds)
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not math.isfinite(margin):
        raise TypeError(f"margin must be a finite number, got {margin!r}")
    links = positive_int("links", links)
    record.require_whole("classify_heads")
    record = record.item(non_negative_int("batch", batch))  # its own tokens, padding left out
    q_tokens = record.query_tokens
    k_tokens = record.key_tokens if record.key_tokens is not None else q_tokens
    rare = None
    if k_tokens is not None:
        rare = set(rare_tokens(k_tokens, k=rare_k, token_frequencies=token_frequencies, token_ids=token_ids))
        if token_frequencies is None and len(rare_tokens(k_tokens, k=2)) < 2:
            rare = None  # one word only (a repeated word): none is rarer than another
    out: list[HeadRoles] = []
    for entry in record.layers:
        _, H, T, S = entry.weights.shape
        W = entry.weights[0].detach().double().cpu()  # (H, T, S)
        bad = W[~torch.isfinite(W)]
        if bad.numel():
            raise ValueError(
                f"layer {entry.layer} ({entry.name}): roles need finite weights, "
                f"found {bad.numel()} that are not, e.g. {float(bad[0]):.3g}"
            )
        qt = q_tokens if q_tokens is not None else [str(i) for i in range(T)]
        kt = k_tokens if k_tokens is not None else [str(j) for j in range(S)]
        if len(qt) != T or len(kt) != S:
            raise ValueError(
                f"layer {entry.layer} ({entry.name}) has T={T}, S={S} but the record has "
                f"{len(qt)} query tokens and {len(kt)} key tokens"
            )
        visible = _visible(mask, W, entry.layer)
        kinds: dict[str, torch.Tensor] = {}
        if k_tokens is not None:  # which keys are [CLS]-like, [SEP]-like, punctuation, rare
            tests = {"cls": CLS_TOKENS.__contains__, "sep": SEP_TOKENS.__contains__, "punct": is_punctuation}
            if rare is not None:
                tests["rare"] = rare.__contains__
            kinds = {name: torch.tensor([test(t) for t in kt], dtype=torch.bool) for name, test in tests.items()}
        for h in range(H):
            scores, chance, entropy, distance, used = _head_scores(W[h], visible, kinds)
            labels = [
                role for role, limit in limits.items()
                if role in scores and scores[role] >= limit and (role not in chance or scores[role] - chance[role] >= margin)
            ]  # fmt: skip
            top = strongest_links(W[h], qt, kt, links, skip_special=k_tokens is not None)
            counts = {name: int(keys.sum()) for name, keys in kinds.items()}
            out.append(HeadRoles(entry.layer, h, scores, labels, distance, entropy, top, entry.name, chance, used, counts))
    return out


def _visible(mask: torch.Tensor | None, W: torch.Tensor, layer: int) -> torch.Tensor:
    """[T, S] bool: the keys each query may see (see the module docstring)."""
    if mask is None:
        return (W != 0).any(dim=0)
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool torch.Tensor (True = may attend), got {mask!r:.80}")
    if tuple(mask.shape) != tuple(W.shape[1:]):
        raise ValueError(f"mask must be [T, S] = {list(W.shape[1:])} for layer {layer}, got {list(mask.shape)}")
    mask = mask.cpu()
    hidden = W.masked_fill(mask, 0.0).abs()
    if bool((hidden > 0).any()):
        raise ValueError(
            f"layer {layer}: the mask hides keys that get weight (|w| up to {float(hidden.max()):.3g}); "
            "is it the mask the model used?"
        )
    return mask


_COLUMNS = ("previous", "next", "self", "cls", "sep", "punct", "broad", "rare")
_MASSES = ("previous_mass", "next_mass", "self_mass")
#: The roles column of a head without a role ("-" means a score that was not measurable).
NO_ROLE = "none"


def role_table(roles: Sequence[HeadRoles], digits: int = 2) -> list[list[str]]:
    """Rows of strings: a header, then layer, head, labels ("none": no role),
    main scores, entropy and distance of each head ("-" where a score was not
    measured)."""

    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    rows = [["layer", "head", "roles", *_COLUMNS, "entropy", "distance"]]
    for r in roles:
        scores = [fmt(r.scores.get(c)) for c in _COLUMNS]
        rows.append(
            [str(r.layer), str(r.head), ",".join(r.labels) or NO_ROLE, *scores, fmt(r.entropy), fmt(r.mean_distance)]
        )
    return rows


def format_roles(roles: Sequence[HeadRoles], digits: int = 2) -> str:
    """``role_table`` as plain text with aligned columns."""
    rows = role_table(roles, digits)
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(wd) for cell, wd in zip(row, widths)).rstrip() for row in rows)


#: What each column of ``role_table`` measures: the legend of the terminal
#: table and of the HTML role table (with the thresholds of ``ROLE_THRESHOLDS``).
SCORE_MEANINGS: dict[str, str] = {
    "previous": "share of queries whose largest weight is on the token just before them (i-1)",
    "next": "share of queries whose largest weight is on the token just after them (i+1)",
    "self": "share of queries whose largest weight is on themselves (i)",
    "cls": "mean weight on sequence-start tokens ([CLS], <s>)",
    "sep": "mean weight on separator and end tokens ([SEP], </s>)",
    "punct": "mean weight on punctuation tokens",
    "broad": "mean entropy of a query's weights over its largest possible value (1 = uniform over the keys it sees)",
    "rare": "mean weight on the rarest word of the text",
    "entropy": "mean entropy of a query's weights, in nats",
    "distance": "mean distance |query position - key position|, weighted by attention",
    "previous_mass": "mean weight on the token just before the query (i-1), whether or not it is the largest",
    "next_mass": "mean weight on the token just after the query (i+1), whether or not it is the largest",
    "self_mass": "mean weight of a query on itself (i), whether or not it is the largest",
}


def role_legend(
    thresholds: Mapping[str, float] | None = None, *, masses: bool = False
) -> list[tuple[str, str, float | None]]:
    """(column, meaning, role threshold or None) for each score column of ``role_table``.

    Args:
        thresholds: overrides merged over ``ROLE_THRESHOLDS``, as in ``classify_heads``.
        masses: also the ``*_mass`` scores (in ``HeadRoles.scores``, heads.json
            and the HTML head view, not in ``role_table``), which give no role.
    """
    limits = _thresholds(thresholds)
    names = (*_COLUMNS, "entropy", "distance", *(_MASSES if masses else ()))
    return [(name, SCORE_MEANINGS[name], limits.get(name)) for name in names]


#: The rule that gives a role, as the legends state it (terminal and HTML).
RULE = (
    f"a head gets a role when its score reaches the threshold and beats chance by {ROLE_MARGIN:.2f} or more "
    "(chance: the score of a head that spreads its weight evenly over the keys each query sees; "
    "0 for previous/next/self, the share of such keys for cls/sep/punct/rare; broad needs its threshold only)"
)
#: What the two dashes of the tables mean.
MARKS = f"'-' in a score column: not measurable on this input; '{NO_ROLE}' in the roles column: no role reached"


def format_legend(
    thresholds: Mapping[str, float] | None = None,
    digits: int = 2,
    *,
    masses: bool = False,
    extra: Sequence[tuple[str, str]] = (),
) -> str:
    """``role_legend`` as plain text: the rule, then one line per column, threshold first.

    ``extra`` (name, meaning) pairs are more columns of the table (such as
    ``importance``), which give no role, after its score columns; ``masses``
    adds the ``*_mass`` scores after them, under a line saying they are not
    in the table.
    """
    rows = [*role_legend(thresholds), *((name, meaning, None) for name, meaning in extra)]
    if masses:
        rows += [(name, SCORE_MEANINGS[name], None) for name in _MASSES]
    width = max(len(name) for name, _, _ in rows)
    lines = textwrap.wrap(f"columns: {RULE}; {MARKS}", 110)
    for name, meaning, limit in rows:
        if masses and name == _MASSES[0]:
            lines.append("scores not in the table (in heads.json and the page's head view):")
        if limit is None:
            rule = "no role"
        else:
            rule = f">= {limit:.{digits}f}" if math.isfinite(limit) else "off"
        lines.append(f"  {name:<{width}}  {rule:<{digits + 5}}  {meaning}")
    return "\n".join(lines)
