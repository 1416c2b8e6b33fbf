"""``corpus_roles`` as a table: each head's mean +- sd over the texts, its evidence, its roles.

    layer  head  roles         texts  previous   ...  cls        ...  punct
    0      2     previous      20     1.00±0.00  ...  0.16±0.06  ...  0.13±0.01
    3      4     none (punct)  20     0.05±0.02  ...  0.30±0.10  ...  0.62±0.20*

``texts`` counts the texts that measured the head; a cell is "mean±sd" over
the texts that measured that score ("mean" alone when one text did, "-" when
none did); ``*`` marks a role's score whose evidence falls short of the
``EvidenceRule``, and a role in brackets in the roles column passed its
threshold and margin on the mean but was withheld for that reason.
"""

from __future__ import annotations

import textwrap

from .corpus_roles import CorpusRoles
from .roles import NO_ROLE, SCORE_MEANINGS, format_legend

__all__ = ["corpus_table", "format_corpus_roles", "corpus_rule", "format_corpus_legend", "corpus_meanings",
           "TEXTS_MEANING", "SPREAD_MARKS"]  # fmt: skip

_COLUMNS = ("previous", "next", "self", "cls", "sep", "punct", "broad", "rare", "entropy", "distance")
#: The texts column, in the terminal legend and the page's.
TEXTS_MEANING = "texts of the corpus that measured the head (each text counts once in every mean)"
#: What the marks of a corpus table mean.
#: The rare score over a corpus reads the corpus's frequencies.
RARE_MEANING = "mean weight on the text's word that is rarest in the corpus"
SPREAD_MARKS = ("each score is mean±sd over the texts that measured it; '*': a role's score measured on too "
                "little to give the role; (role) in the roles column: its mean passed, its evidence did not")  # fmt: skip


def corpus_meanings() -> dict[str, str]:
    """``roles.SCORE_MEANINGS`` as they read over a corpus (the rare word is the corpus's rarest)."""
    return {**SCORE_MEANINGS, "rare": RARE_MEANING}


def corpus_rule(found: CorpusRoles) -> str:
    """The rule a corpus role follows, as one sentence."""
    return (f"a head gets a role when its mean score over the texts reaches the threshold, beats the mean chance by "
            f"{found.margin:.2f} or more (broad: its threshold only) and was {found.evidence.describe()}")  # fmt: skip


def _cell(found_head, name: str, digits: int) -> str:
    s = found_head.stats.get(name)
    if s is None:
        return "-"
    text = f"{s.mean:.{digits}f}" + (f"±{s.sd:.{digits}f}" if s.sd is not None else "")
    return text + ("*" if found_head.enough.get(name) is False else "")


def corpus_table(found: CorpusRoles, digits: int = 2) -> list[list[str]]:
    """Rows of strings: a header, then one row per head (see the module docstring)."""
    rows = [["layer", "head", "roles", "texts", *_COLUMNS]]
    for h in found.heads:
        roles = ",".join(h.labels) or NO_ROLE
        if h.withheld:
            roles += f" ({','.join(h.withheld)})"
        rows.append([str(h.layer), str(h.head), roles, str(h.texts), *(_cell(h, c, digits) for c in _COLUMNS)])
    return rows


def format_corpus_roles(found: CorpusRoles, digits: int = 2) -> str:
    """``corpus_table`` as plain text with aligned columns."""
    rows = corpus_table(found, digits)
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_corpus_legend(found: CorpusRoles, digits: int = 2) -> str:
    """The rule, the marks, then one line per column (``roles.format_legend``'s column lines)."""
    lines = textwrap.wrap(f"corpus of {found.texts} texts: {corpus_rule(found)}; {SPREAD_MARKS}", 110)
    columns = format_legend(found.thresholds, digits, extra=[("texts", TEXTS_MEANING)]).splitlines()
    columns = [line.replace(SCORE_MEANINGS["rare"], RARE_MEANING) for line in columns if line.startswith("  ")]
    return "\n".join(lines + columns)
