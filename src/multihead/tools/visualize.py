"""Views of captured attention: one self-contained HTML page, a PNG grid, JSON.

    with capture(model) as record:
        model(x)
    record.query_tokens = tokens
    write_html(record, "heads.html", roles=roles)   # open it from disk
    write_png(record, "heads.png")                  # needs multihead[viz]
    write_json(record, "heads.json", roles=roles)

The HTML page has three parts, all drawn by the page's own script from the
JSON embedded in it (no network, no fonts, no CDN; it works from file://)::

    head view (one layer; its heads toggled,  model view (layers x heads)
    one colour each; the page's width)          H0    H1    H2
      queries        keys                    L0 [▦]   [▦]   [▦]
      <s>   ───────  <s>                     L1 [▦]   [▦]   [▦]   click: open
      the   ──╲────  the                                          in head view
      cat   ───╲───  cat                     (cells shrink to fit the width,
            (line opacity and width = weight;  down to 48 px; past that the
            hover a token to follow it, click   grid scrolls and says so)
            to pin it, Escape to let go)

    role table (layer, head, labels, scores), when roles are given;
    click a column header to sort by it; hover it for what it measures

``legend`` explains the role table's columns (header tooltips and a list
under the table): ``{"previous": {"meaning": "...", "threshold": 0.9}}``
(``roles.role_legend`` gives it). ``notices`` are sentences shown at the
top of the page (a text that was cut, words the tokenizer did not know).

``roles`` is a plain structure so this module does not depend on the roles
tool: a list of mappings (or objects with these attributes, such as
``roles.HeadRoles``) ``{"layer": 0, "head": 3, "labels": [...], "scores":
{...}}`` (and ``"chance"``, a HeadRoles' baselines, kept in heads.json).
Roles over a corpus (``corpus_roles.CorpusHeadRoles.to_dict``) add
``"spread"``, ``"interval"``, ``"evidence"``, ``"texts"`` and
``"withheld"``: the role table then shows each cell as mean ± sd with its
evidence as the tooltip, a ``texts`` column, and the withheld roles.
``layer`` is ``LayerAttention.layer``; when a module was called
more than once, the k-th role for (layer, head) belongs to its k-th call.

Colours in the heatmaps are sqrt(weight) on a fixed 0..1 scale, so weak
links stay visible and heads remain comparable.

``batch`` picks one batch item through ``AttentionRecord.item``: its own
tokens (one token list per item for a batch of different texts) and,
with ``record.attention_mask``, without its padding. Tokens are shown by
``token_text.readable_tokens`` (byte-level ``Ġ`` as a visible space
``␣``); the page keeps each raw token as its tooltip and in heads.json.
Each writer refuses a path whose folder does not exist before any work.

``causal`` (``commands.inspect_causal.causal_view``: ``"roles"``, a list
of ``{"name", "meaning", "threshold", "chance"}`` in the order shown, and
``"scores"``, role -> L lists of H numbers or null) puts a causal model's
roles first on the page, a section of their own above the head view, and
into heads.json; without it the page has no such section.

``slots`` (a ``head_slots.HeadSlots``) draws a pruned model with every
layer's heads before pruning: the removed ones as grey cells labelled
"pruned", the kept ones with their index before pruning when known; the
titles count the heads kept, and heads.json gets ``"pruned"`` (``{"layer",
"head"}``, head = index before pruning or null), ``"num_heads"`` and each
layer's ``"original_heads"``. A role with an ``"importance"`` score shows
it in the model view's cells and the PNG's titles.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import os
import re
import textwrap
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

import torch

from .._checks import positive_int
from ..io import write_bytes_atomic
from .capture import AttentionRecord
from .head_slots import HeadSlots
from .token_text import readable_tokens
from .view_checks import causal_entries as _causal
from .view_checks import check_slots as _check_slots
from .view_checks import folder_of as _folder_of
from .view_checks import legend_entries as _legend
from .view_checks import match_roles as _match_roles
from .view_checks import strings as _strings
from .view_checks import validate as _validate

__all__ = ["write_html", "write_png", "write_json"]

_VIZ_HINT = "pip install 'multihead[viz]'"
_DIGITS = 4  # weights in the page: 1e-4 is below what a line or a pixel can show
_PLACEHOLDER = re.compile(r"\{\{(TITLE|CSP|CSS|DATA|JS)\}\}")
# Characters that could end a <script> element or an HTML comment, or that
# older JavaScript parsers treat as line ends, written as JSON \u escapes.
_SCRIPT_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def write_html(
    record: AttentionRecord,
    path: str | os.PathLike,
    *,
    roles: list | None = None,
    title: str | None = None,
    batch: int = 0,
    legend: Mapping | None = None,
    notices: list[str] | None = None,
    slots: HeadSlots | None = None,
    causal: Mapping | None = None,
) -> Path:
    """Write one self-contained HTML page: head view, model view, role table.

    Token strings are embedded as JSON and inserted into the page as text,
    never as HTML; a Content-Security-Policy allows only the page's own
    script and style (by hash) and no network access at all.

    Args:
        record: from ``capture``, all layers with the same T and S.
        path: the .html file to write (replaced atomically).
        roles: optional per-head roles, see the module docstring.
        title: page title; default from ``record.source``.
        batch: which batch item to show.
        legend: column name -> {"meaning": str, "threshold": number or None}
            (or just the meaning as a str), see the module docstring.
        notices: sentences shown at the top of the page.
        slots: the heads before pruning, see the module docstring.
        causal: a causal model's role scores, see the module docstring.

    Returns:
        ``path`` as a Path.

    Raises:
        TypeError: record not an AttentionRecord, tokens not strings, bad
            roles, legend or notices of the wrong types.
        ValueError: empty record, tokens not matching T/S, batch out of range,
            roles naming a layer or head that is not in the record, slots
            whose kept heads do not match the record's head counts, one
            token list for batch items whose padding differs.
        FileNotFoundError: the folder of ``path`` does not exist.
    """
    _folder_of(path)
    page = page_html(
        record, roles=roles, title=title, batch=batch, legend=legend, notices=notices, slots=slots, causal=causal
    )
    return write_bytes_atomic(path, page.encode("utf-8"))


def page_html(
    record: AttentionRecord,
    *,
    roles: list | None = None,
    title: str | None = None,
    batch: int = 0,
    legend: Mapping | None = None,
    notices: list[str] | None = None,
    slots: HeadSlots | None = None,
    causal: Mapping | None = None,
    options: Mapping | None = None,
) -> str:
    """The page ``write_html`` writes, as a str (checks as ``write_html``, without the path).

    ``options`` go into the page's data as they are (the notebook views,
    ``tools.views``, set them): ``"view"`` ("head": no model view; "model":
    the head view hidden until a model-view cell is clicked), ``"start"`` (``{"row",
    "heads"}``: what the head view shows first), ``"sides"`` (the two token
    columns' titles), ``"row_titles"`` (a name per drawn row), ``"summary"``
    (the line under the title).
    """
    record, tokens = _validate(record, batch)
    role_rows = _match_roles(roles, record)
    _check_slots(slots, record)
    if title is None:
        title = f"{record.source} attention" if record.source else "Attention"
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    data = {
        "title": title,
        "source": record.source,
        "batch": batch,
        "query_tokens": tokens[0],
        "key_tokens": tokens[1],
        "query_labels": readable_tokens(tokens[0]),
        "key_labels": readable_tokens(tokens[1]),
        "layers": [
            {"layer": e.layer, "name": e.name, "kind": e.kind, "weights": _finite_rounded(e.weights[0])}
            for e in record.layers
        ],
        "roles": [dict(r, row=row) for row, r in role_rows] if roles is not None else None,
        "legend": _legend(legend),
        "notices": _strings("notices", notices) if notices is not None else [],
    }
    if causal is not None:  # left out for an encoder: its page has no causal section
        data["causal"] = _causal(causal)
    if slots is not None:  # left out for an unpruned model: its page stays as it was
        data["slots"] = {
            "num_heads": slots.num_heads,
            "original": slots.original,
            "summary": slots.summary([e.layer for e in record.layers]),
            "layers": [  # per drawn row: each slot's current head (None: removed) and index before pruning
                [{"head": h, "original": s if slots.original else None} for s, h in enumerate(slots.slots(e.layer))]
                for e in record.layers
            ],
        }
    data.update(options or {})
    css, js = _asset("heads.css"), _asset("heads.js")
    csp = (
        f"default-src 'none'; script-src '{_sha256(js)}'; style-src '{_sha256(css)}'; "
        "img-src data:; base-uri 'none'; form-action 'none'"
    )
    parts = {"TITLE": html.escape(title), "CSP": csp, "CSS": css, "DATA": _script_json(data), "JS": js}
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _asset("heads.html"))


def write_png(
    record: AttentionRecord,
    path: str | os.PathLike,
    *,
    roles: list | None = None,
    batch: int = 0,
    max_tokens: int | None = None,
    slots: HeadSlots | None = None,
) -> Path:
    """Write a grid of heatmaps (rows = layers, columns = heads) as PNG.

    Token labels go on the outer axes when at most 40 tokens are shown;
    role labels go into each heatmap's title. Drawn with matplotlib's Agg
    canvas (no display, no global pyplot state).

    Args:
        record: from ``capture``, all layers with the same T and S.
        path: the .png file to write (replaced atomically).
        roles: optional per-head roles, see the module docstring.
        batch: which batch item to show.
        max_tokens: show only the first ``max_tokens`` queries and keys.
        slots: the heads before pruning, see the module docstring.

    Returns:
        ``path`` as a Path.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'multihead[viz]'``).
        TypeError, ValueError: as ``write_html``; max_tokens not a positive int.
    """
    try:
        import matplotlib  # noqa: F401  (the optional dependency itself)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import PowerNorm
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(f"write_png needs matplotlib, which is not installed: {_VIZ_HINT}") from exc
    _folder_of(path)
    record, (q_tokens, k_tokens) = _validate(record, batch)
    _check_slots(slots, record)
    if max_tokens is not None:
        max_tokens = positive_int("max_tokens", max_tokens)
        q_tokens, k_tokens = q_tokens[:max_tokens], k_tokens[:max_tokens]
    matched = _match_roles(roles, record)
    labels_of = {(row, r["head"]): r["labels"] for row, r in matched}
    importance = {(row, r["head"]): r["scores"]["importance"] for row, r in matched if "importance" in r["scores"]}
    T, S = len(q_tokens), len(k_tokens)
    rows, cols = len(record.layers), slots.num_heads if slots else max(e.num_heads for e in record.layers)
    # grid[row][col]: the head drawn in that column, None for a removed head
    grid = [slots.slots(e.layer) if slots else tuple(range(e.num_heads)) for e in record.layers]
    # Layout in inches, placed by hand (constrained layout takes seconds on 144 axes).
    cell = max(1.4, 0.11 * max(T, S))
    with_tokens = max(T, S) <= 40 and max(rows, cols) * cell <= 24
    if not with_tokens:
        cell = 1.4 if cols <= 12 else max(0.8, 17 / cols)
    layer_names = _layer_names(record)
    titles = {
        (row, col): "\n".join([_cell_name(layer_names[row], col, head, slots), *_cell_lines(labels_of.get((row, head), []),
                                                                                importance.get((row, head)), cell)])
        for row, heads in enumerate(grid)
        for col, head in enumerate(heads)
    }  # fmt: skip
    title_h = 0.1 + 0.14 * max(t.count("\n") + 1 for t in titles.values())
    q_labels, k_labels = [_plain(_short(t)) for t in readable_tokens(q_tokens)], [
        _plain(_short(t)) for t in readable_tokens(k_tokens)
    ]
    left = 0.3 + (0.055 * max(map(len, q_labels)) if with_tokens else 0)
    bottom = 0.2 + (0.055 * max(map(len, k_labels)) if with_tokens else 0)
    top, right, gap = 0.6, 1.2, 0.15
    width = left + cols * cell + (cols - 1) * gap + right
    height = top + rows * (title_h + cell) + (rows - 1) * gap + bottom
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    norm, image = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0), None
    # token labels on the lowest drawn heatmap of each column and the first of each row
    lowest = {c: max((r for r, heads in enumerate(grid) if c < len(heads) and heads[c] is not None), default=-1)
              for c in range(cols)}  # fmt: skip
    first = [next(c for c, h in enumerate(heads) if h is not None) for heads in grid]
    for row, entry in enumerate(record.layers):
        weights = entry.weights[0, :, :T, :S].detach().double().nan_to_num(0.0, 0.0, 0.0)
        y = height - top - row * (title_h + cell + gap) - title_h - cell
        for col, head in enumerate(grid[row]):
            x = left + col * (cell + gap)
            ax = fig.add_axes((x / width, y / height, cell / width, cell / height))
            if head is None:  # a removed head: an empty grey cell
                ax.set_facecolor("#d0d0d0")
                ax.text(0.5, 0.5, "pruned", color="#555555", fontsize=9, ha="center", va="center",
                        transform=ax.transAxes)  # fmt: skip
            else:
                w = weights[head].numpy()
                image = ax.imshow(w, cmap="viridis", norm=norm, interpolation="nearest", aspect="auto")
            ax.set_title(_plain(titles[(row, col)]), fontsize=8, pad=3, color="#777777" if head is None else "black")
            ax.tick_params(length=2, pad=1)  # ticks (each an object, slow to draw) only on the outer axes
            if with_tokens and row == lowest[col] and head is not None:
                ax.set_xticks(range(S), k_labels, rotation=90, fontsize=6)
            else:
                ax.set_xticks([])
            if with_tokens and col == first[row] and head is not None:
                ax.set_yticks(range(T), q_labels, fontsize=6)
            else:
                ax.set_yticks([])
    bar_h = min(3.0, height - top - bottom)
    cax = fig.add_axes(((width - right + 0.3) / width, (height - top - bar_h) / height, 0.14 / width, bar_h / height))
    fig.colorbar(image, cax=cax).set_label("attention weight (sqrt scale)", fontsize=8)
    cax.tick_params(labelsize=7)
    name = _plain(record.source or "attention")
    if slots:
        heads = slots.summary([e.layer for e in record.layers])
    else:
        drawn = f"layer {record.layers[0].layer}" if rows == 1 else _plural(rows, "call" if _repeated(record) else "layer")
        heads = f"{drawn} x {_plural(cols, 'head')}"
    fig.suptitle(f"{name}: {heads} (rows = queries, columns = keys)", fontsize=10, y=1 - 0.2 / height)

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return write_bytes_atomic(path, buffer.getvalue())


def write_json(
    record: AttentionRecord,
    path: str | os.PathLike,
    *,
    roles: list | None = None,
    batch: int = 0,
    slots: HeadSlots | None = None,
    causal: Mapping | None = None,
) -> Path:
    """Write ``record.to_dict(batch)`` plus ``"roles"`` (and ``"causal"``) as JSON (atomically).

    ``AttentionRecord.from_dict`` reads the file back (it ignores ``roles``
    and what ``slots`` adds, see the module docstring).

    Raises:
        TypeError, ValueError, FileNotFoundError: as ``write_html``.
    """
    _folder_of(path)
    record, _ = _validate(record, batch)  # batch item ``batch`` alone
    _check_slots(slots, record)
    payload = record.to_dict(0)
    payload["roles"] = [r for _, r in _match_roles(roles, record)] if roles is not None else None
    if causal is not None:
        payload["causal"] = _causal(causal)
    if slots is not None:
        payload["num_heads"] = slots.num_heads
        payload["pruned"] = [
            {"layer": e.layer, "head": s if slots.original else None}
            for e in record.layers
            for s in slots.pruned(e.layer)
        ]
        for entry, out in zip(record.layers, payload["layers"]):
            out["original_heads"] = [slots.original_index(entry.layer, h) for h in range(entry.num_heads)]
        for role in payload["roles"] or []:
            role["original_head"] = slots.original_index(role["layer"], role["head"])
    return write_bytes_atomic(path, json.dumps(payload, allow_nan=False).encode("utf-8"))


# -- PNG titles -----------------------------------------------------------------


def _repeated(record: AttentionRecord) -> bool:
    """True when a layer was called more than once (a generation loop): rows are then calls."""
    layers = [e.layer for e in record.layers]
    return len(set(layers)) != len(layers)


def _layer_names(record: AttentionRecord) -> list[str]:
    """Each drawn row's name: "L4" (the model's layer number), or "C2 (L0)" for the calls of a repeated layer."""
    if _repeated(record):
        return [f"C{row} (L{e.layer})" for row, e in enumerate(record.layers)]
    return [f"L{e.layer}" for e in record.layers]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _cell_name(layer: str, col: int, head: int | None, slots: HeadSlots | None) -> str:
    """A PNG cell's first title line: "L0 H1", "L0 H1 (was H2)", "L0 pruned (was H2)" or "L0 pruned"."""
    if head is None:
        return f"{layer} pruned (was H{col})" if slots.original else f"{layer} pruned"
    return f"{layer} H{head}" + (f" (was H{col})" if slots and slots.original and col != head else "")


def _cell_lines(labels: list[str], importance: float | None, cell: float) -> list[str]:
    """A PNG cell's role labels (wrapped to the cell) and importance score."""
    lines = textwrap.wrap(", ".join(labels), int(cell * 12))
    return lines if importance is None else [*lines, f"importance {importance:.4f}"]


# -- output helpers -------------------------------------------------------------


def _finite_rounded(weights: torch.Tensor) -> list:
    """[H, T, S] nested lists, non-finite values as 0, rounded to _DIGITS."""
    return weights.detach().double().nan_to_num(0.0, 0.0, 0.0).round(decimals=_DIGITS).tolist()


def _script_json(data) -> str:
    """JSON that is safe inside <script>: no "</", "<!--", "&" or U+2028/9 can appear raw."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return re.sub("[<>&\u2028\u2029]", lambda m: _SCRIPT_ESCAPES[m.group(0)], text)


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def _short(token: str, limit: int = 14) -> str:
    return token if len(token) <= limit else token[: limit - 1] + "\u2026"


def _plain(text: str) -> str:
    """Text matplotlib shows as is: a "$" would otherwise start math mode."""
    return text.replace("$", r"\$")

