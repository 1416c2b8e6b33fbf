"""Views of a ``HeadEffects`` map: a self-contained HTML heatmap page and a PNG.

    write_effects_html(effects, "effects.html", title="IOI patching", details={"clean": "...", ...})
    write_effects_png(effects, "effects.png", title="IOI patching")   # needs matplotlib (multihead[viz])

Both draw the layers x heads map on a signed colour scale centred on 0 and
symmetric: blue for a negative effect, red for a positive one, white for
none, full colour at the largest |effect| of the map (``scale_of``). A head
that was not measured (or that a pruned layer lacks) is grey with a dash.

The page is one file with no network, fonts or scripts from elsewhere (it
opens from file://): a table whose cells carry ``data-layer``,
``data-head`` and ``data-effect`` (the full value), each cell's value
printed in it and in its tooltip; hovering or focusing a cell writes
"layer l, head h (module name): effect" into the readout line under the
map. Every text (title, details, module names) is escaped, never run.
"""

from __future__ import annotations

import html
import io
import math
import os
from collections.abc import Mapping
from pathlib import Path

from ..io import write_bytes_atomic, write_text_atomic
from .head_effects import HeadEffects
from .view_checks import folder_of

__all__ = ["write_effects_html", "write_effects_png", "scale_of", "cell_colour"]

NEGATIVE, POSITIVE, GREY = (33, 102, 172), (178, 24, 43), "#d9d9d9"
_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #222; }
h1 { font-size: 1.3rem; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2rem 1rem; }
dt { font-weight: 600; } dd { margin: 0; white-space: pre-wrap; }
#effects-grid { border-collapse: collapse; margin: 1rem 0; }
#effects-grid th { font-weight: 600; padding: 0.2rem 0.5rem; font-size: 0.85rem; }
#effects-grid th.layer { text-align: right; } #effects-grid th.layer span { color: #777; font-weight: 400; }
#effects-grid td { width: 4.2rem; height: 2.2rem; text-align: center; font-size: 0.8rem; border: 1px solid #fff;
                   font-variant-numeric: tabular-nums; cursor: default; }
#effects-grid td:hover, #effects-grid td:focus { outline: 2px solid #222; }
#scale { display: flex; align-items: center; gap: 0.5rem; font-size: 0.85rem; }
#scale-bar { width: 16rem; height: 0.9rem; border: 1px solid #aaa;
             background: linear-gradient(to right, rgb(33,102,172), #fff, rgb(178,24,43)); }
#readout { min-height: 1.4rem; font-variant-numeric: tabular-nums; }
"""
_SCRIPT = """
(function () {
  const readout = document.getElementById("readout");
  for (const cell of document.querySelectorAll("#effects-grid td")) {
    const show = () => { readout.textContent = cell.getAttribute("aria-label"); };
    cell.addEventListener("mouseenter", show);
    cell.addEventListener("focus", show);
  }
  document.body.dataset.ready = "true";
})();
"""


def scale_of(effects: HeadEffects) -> float:
    """The largest |effect| of the map (1.0 when every measured effect is 0 or none was measured)."""
    values = [abs(v) for v in effects.effects.flatten().tolist() if v == v]
    top = max(values, default=0.0)
    return top if top > 0 and math.isfinite(top) else 1.0


def cell_colour(value: float, scale: float) -> tuple[int, int, int]:
    """RGB of ``value`` on the signed scale [-scale, scale]: white at 0, blue below, red above."""
    t = max(-1.0, min(1.0, value / scale))
    end = POSITIVE if t > 0 else NEGATIVE
    return tuple(round(255 + (c - 255) * abs(t)) for c in end)


def _number(value: float) -> str:
    return f"{value:+.3g}"


def write_effects_html(
    effects: HeadEffects, path: str | os.PathLike, *, title: str = "Head effects", details: Mapping[str, str] | None = None
) -> Path:
    """Write the map as one self-contained HTML page (module docstring).

    Args:
        effects: from ``head_effects``.
        path: the .html file (replaced atomically; its folder must exist).
        title: the page's heading.
        details: label -> text lines shown above the map (prompts, answers, ...).

    Returns:
        ``path`` as a Path.

    Raises:
        TypeError: ``effects`` is not a ``HeadEffects``.
        FileNotFoundError / NotADirectoryError: the folder does not exist or is a file.
    """
    _check(effects, path)
    scale = scale_of(effects)
    base = "corrupted" if effects.method == "restore" else "clean"
    rows = []
    for i, name in enumerate(effects.layer_names):
        cells = []
        for h, value in enumerate(effects.effects[i].tolist()):
            if value != value:
                what = "no such head" if h >= effects.num_heads[i] else "not measured"
                label = f"layer {i}, head {h} ({name}): {what}"
                cells.append(f'<td data-layer="{i}" data-head="{h}" data-effect="" tabindex="0" style="background:{GREY}" '
                             f'title="{html.escape(label)}" aria-label="{html.escape(label)}">&ndash;</td>')  # fmt: skip
                continue
            r, g, b = cell_colour(value, scale)
            ink = "#fff" if abs(value) / scale > 0.55 else "#222"
            label = f"layer {i}, head {h} ({name}): {value:+.6g}"
            cells.append(f'<td data-layer="{i}" data-head="{h}" data-effect="{value!r}" tabindex="0" '
                         f'style="background:rgb({r},{g},{b});color:{ink}" title="{html.escape(label)}" '
                         f'aria-label="{html.escape(label)}">{_number(value)}</td>')  # fmt: skip
        rows.append(f'<tr><th class="layer" scope="row">L{i} <span>{html.escape(name)}</span></th>{"".join(cells)}</tr>')
    heads = "".join(f'<th scope="col">H{h}</th>' for h in range(effects.effects.shape[1]))
    facts = {"method": _method_text(effects.method), **(details or {}), "metric, clean run": f"{effects.clean:+.6g}"}
    if effects.corrupted is not None:
        facts["metric, corrupted run"] = f"{effects.corrupted:+.6g}"
    listed = "".join(f"<dt>{html.escape(str(k))}</dt><dd>{html.escape(str(v))}</dd>" for k, v in facts.items())
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head>
<body data-ready="false">
<h1 id="page-title">{html.escape(title)}</h1>
<dl id="details">{listed}</dl>
<p id="meaning">Each cell: the metric with that head's output replaced, minus the metric of the {base} run
({effects.baseline:+.6g}).</p>
<table id="effects-grid"><thead><tr><th></th>{heads}</tr></thead><tbody>{"".join(rows)}</tbody></table>
<div id="scale"><span id="scale-min">{-scale:+.3g}</span><div id="scale-bar"></div><span id="scale-max">{scale:+.3g}</span></div>
<p id="readout">hover a cell for its value</p>
<script>{_SCRIPT}</script>
</body></html>
"""
    return write_text_atomic(path, page)


def _method_text(method: str) -> str:
    return {
        "zero": "zero: the head's output replaced by zeros (clean run)",
        "mean": "mean: the head's output replaced by its mean over the clean batch and positions (clean run)",
        "patch": "patch: the head's output taken from the corrupted run (clean run)",
        "restore": "restore: the head's output taken from the clean run (corrupted run)",
    }[method]


def _check(effects: HeadEffects, path) -> None:
    if not isinstance(effects, HeadEffects):
        raise TypeError(f"effects must be a HeadEffects (from head_effects), got {type(effects).__name__}")
    folder_of(path)


def write_effects_png(effects: HeadEffects, path: str | os.PathLike, *, title: str = "Head effects") -> Path:
    """Write the map as a PNG heatmap with its values and a colour bar (matplotlib's Agg canvas).

    Raises:
        ImportError: matplotlib is not installed (``pip install 'multihead[viz]'``).
        TypeError / ValueError: as ``write_effects_html``.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import ListedColormap
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("write_effects_png needs matplotlib, which is not installed: pip install 'multihead[viz]'") from exc
    _check(effects, path)
    scale = scale_of(effects)
    L, H = effects.effects.shape
    data = effects.effects.numpy()
    steps = [cell_colour(scale * (2 * k / 255 - 1), scale) for k in range(256)]
    cmap = ListedColormap([(r / 255, g / 255, b / 255) for r, g, b in steps]).with_extremes(bad=GREY)
    fig = Figure(figsize=(1.6 + 0.75 * H, 1.4 + 0.55 * L))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    image = ax.imshow(data, cmap=cmap, vmin=-scale, vmax=scale, aspect="auto", interpolation="nearest")
    if L * H <= 400:
        for i in range(L):
            for h in range(H):
                v = data[i, h]
                text, ink = ("-", "#555") if v != v else (_number(float(v)), "white" if abs(v) / scale > 0.55 else "black")
                ax.text(h, i, text, ha="center", va="center", fontsize=7, color=ink)
    ax.set_xticks(range(H), [f"H{h}" for h in range(H)], fontsize=8)
    ax.set_yticks(range(L), [f"L{i}" for i in range(L)], fontsize=8)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(f"{title}\n{effects.method}: metric change vs {effects.baseline:+.4g}", fontsize=9)
    fig.colorbar(image, ax=ax).set_label("effect on the metric", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return write_bytes_atomic(path, buffer.getvalue())
