"""What ``multihead inspect`` prints and writes: a short summary by default, every head with
``--verbose``, and heads.html, heads.png and heads.json (``report``). A causal model's roles
(``inspect_causal.format_causal``) come first, before the roles on the text.

The summary (``format_summary``)::

    roles: 54 of 72 heads have one; a role needs ...
      previous  >= 0.90   1 head    L0 H2 1.00
      next      >= 0.90   no head   closest: L1 H8 0.73
      cls       >= 0.50  37 heads   L2 H7 0.85, L2 H9 0.83, L4 H5 0.78, +34 more
      ...
      none               18 heads   (no role)
    top links (query -> key: weight, head):
      never -> will   1.00  L0 H2 previous
      ...

Each role line lists its heads strongest first (at most ``per_role``); a role
no head has names the head that came closest. The links are the strongest
of all heads' ``shown_links`` between two tokens that are not special
([CLS], [SEP]: most heads put much of their weight there) and not the same
position, each (query, key) pair once. ``--verbose`` prints the table of
every head, the legend of its columns and each head's links instead
(``format_links``). Tokens are shown by ``tools.token_text.readable_tokens``;
a word that occurs more than once carries its position (``be#5``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..tools.capture import AttentionRecord
from ..tools.causal_roles import CausalScores
from ..tools.head_links import Link, strongest_links
from ..tools.head_slots import HeadSlots
from ..tools.roles import (
    MARKS,
    NO_ROLE,
    ROLE_MARGIN,
    ROLE_THRESHOLDS,
    RULE,
    HeadRoles,
    format_legend,
    format_roles,
    role_legend,
)  # fmt: skip
from ..tools.token_kinds import is_special
from ..tools.token_text import readable_tokens
from .head_scores import IMPORTANCE_MEANING, format_head_table
from .inspect_causal import causal_view, format_causal

__all__ = ["Inspection", "plural", "head_name", "token_label", "format_summary", "format_links", "shown_links", "report"]


@dataclass
class Inspection:
    """Everything ``inspect_text`` found.

    Attributes:
        record: the captured weights, with tokens and source.
        token_ids: the ids the model read.
        roles: one ``HeadRoles`` per recorded head.
        visible: [T, S] bool, the keys each query was allowed to see.
        analysed: the part of the text that was analysed.
        total_tokens: tokens of the whole text (more than ``token_ids`` when cut).
        notices: what the reader must know (text cut, words not understood).
        slots: a pruned model's heads before pruning (None: nothing pruned).
        causal: a causal model's head scores on repeated random tokens
            (None for an encoder).
    """

    record: AttentionRecord
    token_ids: list[int]
    roles: list[HeadRoles]
    visible: torch.Tensor
    analysed: str
    total_tokens: int
    notices: list[str] = field(default_factory=list)
    slots: HeadSlots | None = None
    causal: CausalScores | None = None


def plural(n: int, word: str) -> str:
    """ "1 layer", "2 layers"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def head_name(r: HeadRoles) -> str:
    return f"L{r.layer} H{r.head}"


def token_label(tokens: Sequence[str], i: int, shown: Sequence[str] | None = None, counts: Counter | None = None) -> str:
    """Token ``i`` as the terminal shows it: readable, ``word#i`` when the word occurs more than once."""
    shown = readable_tokens(tokens) if shown is None else shown
    counts = Counter(tokens) if counts is None else counts
    return f"{shown[i]}#{i}" if counts[tokens[i]] > 1 else shown[i]


def _role_lines(roles: Sequence[HeadRoles], per_role: int) -> list[str]:
    width = max(len(name) for name in (*ROLE_THRESHOLDS, NO_ROLE))
    lines = []
    for role, limit in ROLE_THRESHOLDS.items():
        scored = [r for r in roles if role in r.scores]
        having = sorted((r for r in scored if role in r.labels), key=lambda r: -r.scores[role])
        rule = f">= {limit:.2f}"
        if not scored:
            lines.append(f"  {role:<{width}}  {rule}  {'-':>9}   not measurable on this input")
        elif not having:
            best = max(scored, key=lambda r: r.scores[role])
            lines.append(f"  {role:<{width}}  {rule}  {'no head':>9}   closest: {head_name(best)} {best.scores[role]:.2f}")
        else:
            shown = ", ".join(f"{head_name(r)} {r.scores[role]:.2f}" for r in having[:per_role])
            more = f", +{len(having) - per_role} more" if len(having) > per_role else ""
            lines.append(f"  {role:<{width}}  {rule}  {plural(len(having), 'head'):>9}   {shown}{more}")
    none = sum(not r.labels for r in roles)
    lines.append(f"  {NO_ROLE:<{width}}  {'':7}  {plural(none, 'head'):>9}   (no role reached)")
    return lines


def _top_links(roles: Sequence[HeadRoles], links: Sequence[Sequence[Link]], tokens: Sequence[str], k: int) -> list[str]:
    best: dict[tuple[int, int], tuple[Link, HeadRoles]] = {}
    for r, head_links in zip(roles, links):
        for link in head_links:
            q, j = link.query_index, link.key_index
            if q == j or is_special(tokens[q]) or is_special(tokens[j]):
                continue
            if (q, j) not in best or abs(link.weight) > abs(best[(q, j)][0].weight):
                best[(q, j)] = (link, r)
    top = sorted(best.values(), key=lambda p: (-abs(p[0].weight), p[1].layer, p[1].head))[:k]
    shown, counts = readable_tokens(tokens), Counter(tokens)
    pairs = [
        f"{token_label(tokens, link.query_index, shown, counts)} -> {token_label(tokens, link.key_index, shown, counts)}"
        for link, _ in top
    ]
    width = max(map(len, pairs), default=0)
    return [
        f"  {pair:<{width}}  {link.weight:.2f}  {head_name(r)}" + (f" {','.join(r.labels)}" if r.labels else "")
        for pair, (link, r) in zip(pairs, top)
    ]


def format_summary(
    roles: Sequence[HeadRoles],
    links: Sequence[Sequence[Link]],
    tokens: Sequence[str],
    *,
    importance: bool = False,
    per_role: int = 4,
    top: int = 8,
) -> str:
    """The default printout: the strongest heads of each role and the top links of all heads.

    Args:
        roles: every head's ``HeadRoles``.
        links: each head's ``shown_links``, in ``roles`` order.
        tokens: the text's tokens (``record.query_tokens``).
        importance: add the heads with the largest ``scores["importance"]``.
        per_role: heads listed per role.
        top: links listed.
    """
    having = sum(bool(r.labels) for r in roles)
    lines = [
        f"roles: {having} of {plural(len(roles), 'head')} have one; a role needs its score to reach the "
        f"threshold and beat chance (an even spread) by {ROLE_MARGIN:.2f}",
        *_role_lines(roles, per_role),
    ]
    if importance:
        scored = [r for r in roles if r.scores.get("importance") is not None and r.scores["importance"] == r.scores["importance"]]
        ranked = sorted(scored, key=lambda r: -r.scores["importance"])[:per_role]  # NaN != NaN: no head there
        lines.append("most important (ablation): " + ", ".join(f"{head_name(r)} {r.scores['importance']:.4f}" for r in ranked))
    found = _top_links(roles, links, tokens, top)
    lines += ["", "top links between words (query -> key, weight, head and its roles; [CLS]/[SEP] and self left out):"]
    lines += found or ["  none"]
    return "\n".join(lines)


def format_links(roles: Sequence[HeadRoles], links: Sequence[Sequence[Link]], tokens: Sequence[str]) -> str:
    """``--verbose``: each head's strongest links, one line per head."""
    shown, counts = readable_tokens(tokens), Counter(tokens)
    lines = ["strongest token links per head (query -> key: weight; word#i = the word at position i)"]
    for r, head_links in zip(roles, links):
        text = ", ".join(
            f"{token_label(tokens, link.query_index, shown, counts)} -> "
            f"{token_label(tokens, link.key_index, shown, counts)}: {link.weight:.2f}"
            for link in head_links
        )
        lines.append(f"  L{r.layer:<2} H{r.head:<2} {text}")
    return "\n".join(lines)


def shown_links(found: Inspection, k: int = 3, *, words: bool = False) -> list[list[Link]]:
    """The ``k`` strongest links of each head (in ``found.roles`` order) as the command shows them.

    Unlike ``HeadRoles.links`` these include special tokens ([CLS], [SEP]:
    much of a head's weight goes there) and leave out queries that may see
    one key only (a causal model's first token always gives it weight 1).
    ``words``: only links between two different positions, neither of them a
    special token (the summary's top links).
    """
    tokens, choice = found.record.query_tokens, found.visible.sum(dim=-1) >= 2  # (T,)
    keep = choice[:, None] & torch.ones_like(found.visible)  # (T, S)
    if words:
        plain = torch.tensor([not is_special(t) for t in tokens])  # (T,)
        keep = keep & plain[:, None] & plain[None, :] & ~torch.eye(len(tokens), dtype=torch.bool)
    out = []
    for entry in found.record.layers:  # classify_heads' order: calls, then heads
        for h in range(entry.num_heads):
            w = entry.weights[0, h].detach().double() * keep  # (T, S), links not shown zeroed
            out.append(strongest_links(w, tokens, tokens, k, skip_special=False))
    return out


def _title(source: str, found: Inspection) -> str:
    """The page title: the model and the text it analysed (shortened in the middle when long)."""
    text = " ".join(found.analysed.split())
    if len(text) > 160:
        text = f"{text[:90]} \u2026 {text[-60:]}"
    if found.total_tokens > len(found.token_ids):
        text += f" (first {len(found.token_ids)} of {found.total_tokens} tokens)"
    return f"{source}: {text}"


def report(
    found: Inspection,
    folder: Path,
    *,
    importance: bool = False,
    verbose: bool = False,
    echo: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Print the summary of ``found`` (with ``verbose``: every head's scores, the legend and each head's
    links); write heads.html, heads.png and heads.json into ``folder`` (checked by ``run`` before the
    model was loaded).

    Returns:
        {"html": ..., "png": ..., "json": ...} paths written.
    """
    from ..tools.visualize import write_html, write_json, write_png

    record, roles, slots = found.record, found.roles, found.slots
    layers = [e.layer for e in record.layers]
    if slots is not None:
        echo(f"{record.source}: {slots.summary(layers)} on")
    else:
        which = f" (layer {layers[0]})" if len(layers) == 1 and layers[0] != 0 else ""
        heads = plural(record.layers[0].num_heads, "head")
        echo(f"{record.source}: {plural(record.num_layers, 'layer')}{which} x {heads} on")
    echo(f"  {' '.join(readable_tokens(record.query_tokens))}")
    for note in found.notices:
        echo(f"notice: {note}")
    echo("")
    if found.causal is not None:  # a causal model's roles lead
        echo(format_causal(found.causal, verbose=verbose))
        echo("")
    if not verbose:
        echo(format_summary(roles, shown_links(found, k=8, words=True), record.query_tokens, importance=importance))
        echo("")
        echo("--verbose prints every head's scores, the legend of the columns and each head's strongest links")
    else:
        if slots is None and not importance:
            echo(format_roles(roles))
        else:
            echo(format_head_table(roles, importance=importance, slots=slots, layers=layers))
        echo("")
        if slots is not None:
            was = "; was: the head's index before pruning (multihead prune's report.json)" if slots.original else ""
            echo(f"pruned rows: heads removed from the model{was}")
        echo(format_legend(masses=True, extra=[("importance", IMPORTANCE_MEANING)] if importance else ()))
        echo("")
        echo(format_links(roles, shown_links(found), record.query_tokens))
    folder.mkdir(parents=True, exist_ok=True)
    title = _title(record.source, found)
    legend = {"roles": {"meaning": f"{RULE}; {MARKS}", "threshold": None}}
    legend.update({name: {"meaning": meaning, "threshold": limit} for name, meaning, limit in role_legend(masses=True)})
    if importance:
        legend["importance"] = {"meaning": IMPORTANCE_MEANING, "threshold": None}
    causal = causal_view(found.causal) if found.causal is not None else None
    paths = {
        "html": write_html(
            record, folder / "heads.html", roles=roles, title=title, legend=legend, notices=found.notices, slots=slots,
            causal=causal,
        ),
        "png": write_png(record, folder / "heads.png", roles=roles, slots=slots),
        "json": write_json(record, folder / "heads.json", roles=roles, slots=slots, causal=causal),
    }  # fmt: skip
    echo("")
    for kind, path in paths.items():
        echo(f"wrote {kind:<4} {path.resolve()}")
    return paths
