"""Attention views inline in a notebook, for any model's attentions.

    outputs = model(**inputs, output_attentions=True)        # any Hugging Face model
    tokens = tokenizer.convert_ids_to_tokens(inputs["input_ids"][0])
    head_view(outputs.attentions, tokens)                    # shown inline in Jupyter
    model_view(outputs.attentions, tokens).save("model.html")
    rollout_view(outputs.attentions, tokens, methods=("rollout", "flow"))

``attentions`` is what ``view_inputs.attention_record`` takes: a tuple or
list of L tensors [B, H, T, S] (a model's ``output_attentions``), or an
``AttentionRecord`` from ``capture``. Cross attention (an encoder-decoder's
``outputs.cross_attentions``, [B, H, T_dec, S_enc]) takes the decoder's
tokens as ``tokens`` and the encoder's as ``key_tokens``.

Each call returns an ``AttentionView``: the page ``visualize.write_html``
writes (its own script and style inlined, no network), shown by Jupyter
through ``_repr_html_`` as an iframe whose ``srcdoc`` holds the whole page,
so two views in one notebook keep their own ids, styles and state. The page
grows its frame to its height. ``save(path)`` writes the same page as a file
(temporary name, then renamed).

- ``head_view``: one layer at a time (a select), its heads toggled, one
  colour each; no model view.
- ``model_view``: the layers x heads grid of heatmaps; a click on a cell
  opens that head in a head view below the grid.
- ``rollout_view``: ``rollout.attention_rollout`` / ``attention_flow`` as
  rows of one head each, output tokens on the left, input tokens on the right.
"""

from __future__ import annotations

import html
import numbers
import os
from pathlib import Path

from ..io import write_bytes_atomic
from .capture import AttentionRecord, LayerAttention
from .rollout import flow as _flow
from .rollout import fused_layers, rollout_steps
from .view_checks import folder_of
from .view_inputs import attention_record
from .visualize import page_html

__all__ = ["AttentionView", "head_view", "model_view", "rollout_view"]

_METHODS = ("rollout", "flow")


class AttentionView:
    """A self-contained attention page: inline in Jupyter (``_repr_html_``), ``save(path)`` to a file.

    Attributes:
        html: the whole HTML document.
        height: the frame's height in pixels before the page sets its own.
    """

    def __init__(self, page: str, height: int, title: str):
        self.html = page
        self.height = height
        self.title = title

    def _repr_html_(self) -> str:
        return (
            f'<iframe class="multihead-view" data-mh-view="" title="{html.escape(self.title)}" '
            f'style="width: 100%; height: {self.height}px; border: 0;" '
            f'srcdoc="{html.escape(self.html, quote=True)}"></iframe>'
        )

    def save(self, path: str | os.PathLike) -> Path:
        """Write the page to ``path`` (replaced atomically); returns ``path`` as a Path.

        Raises:
            FileNotFoundError: the folder of ``path`` does not exist.
        """
        folder_of(path)
        return write_bytes_atomic(path, self.html.encode("utf-8"))

    def __repr__(self) -> str:
        return f"AttentionView({self.title!r}, {len(self.html)} characters; shown inline in Jupyter, .save(path))"


def head_view(
    attentions,
    tokens=None,
    *,
    key_tokens=None,
    layer: int | None = None,
    heads=None,
    layers=None,
    batch: int = 0,
    attention_mask=None,
    title: str | None = None,
) -> AttentionView:
    """One layer's heads as lines from queries (left) to keys (right); a select picks the layer.

    Args:
        attentions: L tensors [B, H, T, S] or an AttentionRecord (module docstring).
        tokens: T token strings (None: a record's own, else 0..T-1).
        key_tokens: S token strings, for cross attention (default: ``tokens``).
        layer: the layer shown first: a position in ``attentions`` (default the first kept).
        heads: the heads drawn first (default head 0; bertviz draws all).
        layers: the positions in ``attentions`` to show (default all).
        batch: which batch item to show.
        attention_mask: [B, S], 0 = padding, left out of the view.
        title: the page's title.

    Raises:
        TypeError, ValueError: as ``view_inputs.attention_record``; a layer not
            shown or a head the layer does not have.
    """
    if layers is not None and not isinstance(layers, (str, bytes)) and hasattr(layers, "__iter__"):
        layers = list(layers)  # read twice: the layers kept, then the one shown first
    record = attention_record(
        attentions, tokens, key_tokens=key_tokens, batch=batch, layers=layers, attention_mask=attention_mask
    )
    options = {"view": "head", "start": _start(record, layer, heads, layers)}
    return _view(record, options, title, rows=1)


def model_view(
    attentions,
    tokens=None,
    *,
    key_tokens=None,
    layers=None,
    batch: int = 0,
    attention_mask=None,
    title: str | None = None,
) -> AttentionView:
    """Every head of every layer as a heatmap (rows = layers, columns = heads); click one to open it.

    Args and Raises: as ``head_view``.
    """
    record = attention_record(
        attentions, tokens, key_tokens=key_tokens, batch=batch, layers=layers, attention_mask=attention_mask
    )
    return _view(record, {"view": "model"}, title, rows=len(record.layers))


def rollout_view(
    attentions,
    tokens=None,
    *,
    methods=("rollout",),
    add_residual: bool = True,
    head_fusion: str = "mean",
    batch: int = 0,
    title: str | None = None,
) -> AttentionView:
    """Rollout and/or flow relevance [T, T] as rows of one head: output tokens to input tokens.

    Args:
        attentions: L tensors [B, H, T, T] or an AttentionRecord (self-attention).
        tokens: T token strings.
        methods: "rollout", "flow" or both (one row each, in this order).
        add_residual, head_fusion: as ``rollout.attention_rollout``.

    Raises:
        ValueError: an unknown or repeated method, flow above
            ``rollout.MAX_FLOW_TOKENS`` tokens, and as ``attention_rollout``.
    """
    if isinstance(methods, str):
        methods = (methods,)
    methods = tuple(methods)
    if not methods or any(m not in _METHODS for m in methods) or len(set(methods)) != len(methods):
        raise ValueError(f"methods must name 'rollout' and/or 'flow' once each, got {methods!r}")
    fused, record = fused_layers(attentions, add_residual, head_fusion, batch, capacities="flow" in methods)
    if tokens is not None:
        record = attention_record(record, tokens)
    relevance = {"rollout": lambda: rollout_steps(fused)[-1], "flow": lambda: _flow(fused)}
    entries = [
        LayerAttention(row, f"relevance through {len(fused)} layers", m, relevance[m]().float()[None, None])
        for row, m in enumerate(methods)
    ]  # each [1, 1, T, T]
    shown = AttentionRecord(entries, record.query_tokens, None, record.source)
    T = len(fused[0])
    options = {
        "view": "both",
        "sides": ["outputs", "inputs"],
        "row_titles": [m.capitalize() for m in methods],
        "summary": f"relevance of the {T} input tokens (right) for each output token (left) after {len(fused)} layers"
        f" \u00b7 {head_fusion} of each layer's heads" + (" \u00b7 residual added" if add_residual else ""),
    }
    return _view(shown, options, title or "Attention " + " and ".join(methods), rows=len(methods))


def _start(record: AttentionRecord, layer, heads, layers) -> dict:
    """{"row", "heads"}: the drawn row of ``layer`` (a position in the attentions) and the heads to draw."""
    positions = list(layers) if layers is not None else list(range(len(record.layers)))
    row = 0
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
            raise TypeError(f"layer must be an int, got {layer!r}")
        if layer not in positions:
            raise ValueError(f"layer={layer} is not shown: the layers shown are {positions}")
        row = positions.index(layer)
    H = record.layers[row].num_heads
    if heads is None:
        return {"row": row, "heads": [0]}
    if heads == "all":
        return {"row": row, "heads": list(range(H))}
    if isinstance(heads, (str, bytes)) or not hasattr(heads, "__iter__"):
        raise TypeError(f"heads must be a list of ints or 'all', got {heads!r}")
    heads = list(heads)
    for h in heads:
        if isinstance(h, bool) or not isinstance(h, numbers.Integral) or not 0 <= h < H:
            raise ValueError(f"heads has {h!r}, but layer {positions[row]} has heads 0..{H - 1}")
    if not heads:
        raise ValueError("heads is empty: name at least one head, or 'all'")
    return {"row": row, "heads": sorted({int(h) for h in heads})}


def _view(record: AttentionRecord, options: dict, title: str | None, rows: int) -> AttentionView:
    page = page_html(record, title=title, options=options)
    T, S = record.layers[0].weights.shape[-2:]
    head = 330 + 22 * max(T, S)
    grid = 200 + 140 * rows
    height = {"head": head, "model": grid}.get(options["view"], head + grid)
    return AttentionView(page, min(height, 1600), title or "Attention")
