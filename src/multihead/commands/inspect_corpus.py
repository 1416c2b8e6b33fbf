"""``multihead inspect --corpus FILE``: head roles over many texts, the views of one.

The file holds one text per line (UTF-8; blank lines are skipped). Every
line is encoded as the main text is (the same tokenizer and maximum; a
longer line is refused with its number, or cut with ``--truncate``), the
model runs over the lines a batch at a time (``--batch-size``) and
``tools.corpus_roles`` scores every head on every line and keeps each
score's mean, spread and evidence over the lines. The page's head and model
views show the main text (TEXT, or the file's first line without one);
its role table, the terminal summary and ``--verbose`` table show the
corpus's roles::

    roles over 12 texts: 44 of 72 heads have one (mean±sd over the texts); a head gets a role when its mean
    score over the texts reaches the threshold, beats the mean chance by 0.25 or more (broad: ...) and was
    measured on >= 3 texts and >= 30 query rows (cls/sep/punct/rare: and >= 3 such key tokens)
      previous  >= 0.90     1 head   L0 H2 1.00±0.00
      cls       >= 0.50   34 heads   L4 H5 0.85±0.08, L2 H9 0.84±0.04, L2 H7 0.83±0.04, L1 H11 0.81±0.04, +30 more
      punct     >= 0.50    no head   closest: L3 H11 0.43±0.13
      ...
      none                28 heads   (no role reached)

    with two lines instead of twelve:
      cls       >= 0.50    no head   7 withheld, too little evidence: L1 H11 0.78±0.07, ... (2 texts, 29 rows, 2 keys)

Refused before the model is loaded: a missing file, an empty one, one that
is not UTF-8, one with no text (blank lines only), ``--importance`` (it
scores the heads on one text). A line the tokenizer cannot use is refused
with its number once the model's tokenizer is known, before any line is run.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from pathlib import Path

from ..paths import input_file
from ..tools.corpus_roles import CorpusRoles, corpus_roles
from ..tools.corpus_stats import CorpusHeadRoles
from ..tools.corpus_table import (
    SPREAD_MARKS,
    TEXTS_MEANING,
    corpus_meanings,
    corpus_rule,
    format_corpus_legend,
    format_corpus_roles,
)  # fmt: skip
from ..tools.roles import NO_ROLE, ROLE_THRESHOLDS, role_legend
from ..tools.token_text import readable_tokens
from .inspect_causal import causal_view, format_causal
from .inspect_report import Inspection, format_links, head_name, plural, shown_links
from .tokens import UNKNOWN_SHARE, Encoded

__all__ = [
    "add_corpus_arguments", "check_corpus", "read_corpus", "encode_corpus", "corpus_notices", "run_corpus",
    "format_corpus_summary", "report_corpus",
]  # fmt: skip


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """``--corpus FILE`` and ``--batch-size N``."""
    parser.add_argument(
        "--corpus", metavar="FILE",
        help="score the roles over every line of this UTF-8 file (one text per line, blank lines skipped): "
             "mean ± sd over the lines and their evidence; the views still show TEXT",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=8, metavar="N", help="--corpus lines per forward pass (default 8)")


def check_corpus(args: argparse.Namespace) -> list[tuple[int, str]] | None:
    """The --corpus lines (``read_corpus``), checked with the options that go with them; None without --corpus."""
    if args.batch_size < 1:
        raise ValueError(f"--batch-size {args.batch_size}: give a positive number of lines per forward pass")
    if args.corpus is None:
        return None
    if args.importance:
        raise ValueError(f"--importance scores the heads on one text; it cannot go with --corpus {args.corpus}")
    return read_corpus(args.corpus)


def read_corpus(path: str) -> list[tuple[int, str]]:
    """(line number from 1, text without its surrounding spaces) of every line of ``path`` that is not blank.

    Raises:
        ValueError: no such file, not readable, empty, not UTF-8, blank lines only.
    """
    file = input_file("--corpus", path, "a UTF-8 text file, one text per line")
    data = file.read_bytes()
    if not data:
        raise ValueError(f"--corpus {path} is empty: give one text per line")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(f"--corpus {path} is not UTF-8 text: byte 0x{data[e.start]:02x} on line {line}") from None
    lines = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"--corpus {path} has no text: its {plural(len(text.splitlines()), 'line')} are blank")
    return lines


def encode_corpus(path: str, lines: list[tuple[int, str]], encode: Callable[[str], Encoded]) -> list[Encoded]:
    """Every line encoded as the main text was; a line it refuses is a ValueError naming the line."""
    out = []
    for n, line in lines:
        try:
            out.append(encode(line))
        except ValueError as e:
            raise ValueError(f"--corpus {path} line {n}: {e}") from None
    return out


def corpus_notices(path: str, lines: list[tuple[int, str]], encoded: list[Encoded]) -> list[str]:
    """What the reader must know about the lines: which were cut (``--truncate``), and when more than
    a quarter of their words became the unknown token."""
    out = []
    cut = [n for (n, _), e in zip(lines, encoded) if e.truncated]
    if cut:
        shown = ", ".join(map(str, cut[:8])) + (f" and {len(cut) - 8} more" if len(cut) > 8 else "")
        were = "was" if len(cut) == 1 else "were"
        out.append(f"{plural(len(cut), 'line')} of {path} {were} longer than the model's maximum of {encoded[0].limit} "
                   f"tokens: only their first tokens were scored (--truncate); line {shown}")  # fmt: skip
    words, unknown = sum(e.words for e in encoded), sum(e.unknown_words for e in encoded)
    if words and unknown > UNKNOWN_SHARE * words:
        out.append(f"{unknown} of {words} words of {path} became {encoded[0].unk_token} (unknown to the tokenizer): "
                   "roles over these lines say little")  # fmt: skip
    return out


def run_corpus(captured, encoded: list[Encoded], *, batch_size: int, layer: int | None) -> CorpusRoles:
    """``tools.corpus_roles`` on the lines with the model that captured the main text."""
    return corpus_roles(captured.model, [(e.ids, e.tokens) for e in encoded], batch_size=batch_size,
                        layers=None if layer is None else [layer], desc="corpus")  # fmt: skip


def _spread(h: CorpusHeadRoles, role: str) -> str:
    s = h.stats[role]
    return f"{s.mean:.2f}" + (f"±{s.sd:.2f}" if s.sd is not None else "")


def _evidence(h: CorpusHeadRoles, role: str) -> str:
    s = h.stats[role]
    keys = "" if s.keys is None else f", {plural(s.keys, 'key')}"
    return f"{plural(s.texts, 'text')}, {plural(s.rows, 'row')}{keys}"


def _listed(chosen: list[CorpusHeadRoles], role: str, per_role: int) -> str:
    shown = ", ".join(f"{head_name(h)} {_spread(h, role)}" for h in chosen[:per_role])
    return shown + (f", +{len(chosen) - per_role} more" if len(chosen) > per_role else "")


def format_corpus_summary(found: CorpusRoles, per_role: int = 4) -> str:
    """The default printout: each role's heads (strongest mean first) with mean±sd; where the evidence
    kept a role from heads whose mean passed, those heads and the evidence of the strongest."""
    heads = found.heads
    having = sum(bool(h.labels) for h in heads)
    lines = textwrap.wrap(f"roles over {plural(found.texts, 'text')}: {having} of {plural(len(heads), 'head')} have "
                          f"one (mean±sd over the texts); {corpus_rule(found)}", 110)  # fmt: skip
    width = max(len(name) for name in (*ROLE_THRESHOLDS, NO_ROLE))
    for role, limit in found.thresholds.items():
        scored = [h for h in heads if role in h.stats]
        ranked = sorted(scored, key=lambda h: -h.stats[role].mean)
        chosen = [h for h in ranked if role in h.labels]
        held = [h for h in ranked if role in h.withheld]
        rule = f">= {limit:.2f}"
        if not scored:
            lines.append(f"  {role:<{width}}  {rule}  {'-':>9}   not measurable on these texts")
            continue
        if chosen:
            line = f"  {role:<{width}}  {rule}  {plural(len(chosen), 'head'):>9}   {_listed(chosen, role, per_role)}"
            lines.append(line + (f"; {len(held)} more withheld (too little evidence)" if held else ""))
        elif held:
            lines.append(f"  {role:<{width}}  {rule}  {'no head':>9}   {len(held)} withheld, too little evidence: "
                         f"{_listed(held, role, per_role)} ({_evidence(held[0], role)})")  # fmt: skip
        else:
            lines.append(f"  {role:<{width}}  {rule}  {'no head':>9}   closest: {head_name(ranked[0])} {_spread(ranked[0], role)}")
    none = sum(not h.labels for h in heads)
    lines.append(f"  {NO_ROLE:<{width}}  {'':7}  {plural(none, 'head'):>9}   (no role reached)")
    return "\n".join(lines)


def _title(source: str, main: Inspection, found: CorpusRoles, path: str) -> str:
    text = " ".join(main.analysed.split())
    if len(text) > 100:
        text = f"{text[:60]} \u2026 {text[-30:]}"
    return f"{source}: roles over {plural(found.texts, 'text')} of {Path(path).name}; views of \u201c{text}\u201d"


def report_corpus(
    main: Inspection,
    found: CorpusRoles,
    path: str,
    folder: Path,
    *,
    verbose: bool = False,
    notices: list[str] = (),
    echo: Callable[[str], None] = print,
) -> dict[str, Path]:
    """Print the corpus's roles (``verbose``: the table, its legend, each head's links on the main
    text) and write heads.html, heads.png, heads.json: the main text's weights, the corpus's roles."""
    from ..tools.visualize import write_html, write_json, write_png

    record, slots = main.record, main.slots
    if slots is not None:
        shape = slots.summary([e.layer for e in record.layers])
    else:
        shape = f"{plural(record.num_layers, 'layer')} x {plural(record.layers[0].num_heads, 'head')}"
    echo(f"{record.source}: {shape}; roles over {plural(found.texts, 'text')} of {path} "
         f"({plural(found.tokens, 'token')}); views of:")  # fmt: skip
    echo(f"  {' '.join(readable_tokens(record.query_tokens))}")
    for note in [*main.notices, *notices]:
        echo(f"notice: {note}")
    echo("")
    if main.causal is not None:  # a causal model's roles on repeated random tokens lead, as without --corpus
        echo(format_causal(main.causal, verbose=verbose))
        echo("")
    if verbose:
        echo(format_corpus_roles(found))
        echo("")
        echo(format_corpus_legend(found))
        echo("")
        echo(format_links(main.roles, shown_links(main), record.query_tokens))
    else:
        echo(format_corpus_summary(found))
        echo("")
        echo("--verbose prints every head's mean±sd and evidence, the legend of the columns and each head's "
             "strongest links on the main text")  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    roles = [h.to_dict() for h in found.heads]
    legend = {"roles": {"meaning": f"{corpus_rule(found)}; {SPREAD_MARKS}", "threshold": None},
              "texts": {"meaning": TEXTS_MEANING, "threshold": None}}  # fmt: skip
    meanings = corpus_meanings()
    legend.update({name: {"meaning": meanings[name], "threshold": t} for name, _, t in role_legend(found.thresholds, masses=True)})
    notes = [*main.notices, *notices, f"the role table holds each head's mean \u00b1 sd over {plural(found.texts, 'text')} "
             f"of {Path(path).name}; the head and model views show the main text"]  # fmt: skip
    causal = causal_view(main.causal) if main.causal is not None else None
    paths = {
        "html": write_html(record, folder / "heads.html", roles=roles, title=_title(record.source, main, found, path),
                           legend=legend, notices=notes, slots=slots, causal=causal),  # fmt: skip
        "png": write_png(record, folder / "heads.png", roles=roles, slots=slots),
        "json": write_json(record, folder / "heads.json", roles=roles, slots=slots, causal=causal),
    }
    echo("")
    for kind, p in paths.items():
        echo(f"wrote {kind:<4} {p.resolve()}")
    return paths
