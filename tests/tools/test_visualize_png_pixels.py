"""The PNG shows the weights themselves: read back pixel by pixel, a head that
attends to itself draws a diagonal and a head that attends to the first key a
column, each in its own heatmap (catches: a blank, transposed or swapped
heatmap, which the size and header checks of test_visualize.py let through)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multihead.tools import AttentionRecord, LayerAttention
from multihead.tools.visualize import write_png

T = 8


def _record() -> AttentionRecord:
    weights = torch.zeros(1, 2, T, T)
    weights[0, 0] = torch.eye(T)  # head 0: each query on itself
    weights[0, 1, :, 0] = 1.0  # head 1: every query on the first key
    layer = LayerAttention(layer=0, name="l0", kind="mha", weights=weights)
    return AttentionRecord([layer], query_tokens=[f"t{i}" for i in range(T)])


def _bright(path) -> np.ndarray:
    """(y, x) of the pixels drawn in the colour map's top colour (weight 1)."""
    image = pytest.importorskip("matplotlib.image").imread(str(path))[..., :3]  # (H, W, 3) floats
    top = np.array(pytest.importorskip("matplotlib").colormaps["viridis"](1.0)[:3])
    return np.argwhere(np.abs(image - top).max(axis=-1) < 0.06)


def _groups(bright: np.ndarray) -> list[np.ndarray]:
    """The bright pixels in groups separated by blank columns of the image, left to right
    (head 0's heatmap, head 1's, then the colour bar's top)."""
    xs = np.unique(bright[:, 1])
    starts = [xs[0], *xs[1:][np.diff(xs) > 3]]
    ends = [*xs[:-1][np.diff(xs) > 3], xs[-1]]
    return [bright[(bright[:, 1] >= a) & (bright[:, 1] <= b)] for a, b in zip(starts, ends)]


def test_png_pixels_show_a_diagonal_and_a_first_key_column(tmp_path):
    bright = _bright(write_png(_record(), tmp_path / "heads.png"))
    assert len(bright) > 50, "no cell is drawn at full weight"
    groups = _groups(bright)
    assert len(groups) == 3, [(g[:, 1].min(), g[:, 1].max()) for g in groups]  # two heatmaps and the bar
    diagonal, column = groups[0], groups[1]
    # head 0: one bright cell per row, stepping right as it goes down (query t, key t)
    assert np.corrcoef(diagonal[:, 0], diagonal[:, 1])[0, 1] > 0.95
    # head 1: a tall, narrow column at its heatmap's left edge (every query, key 0)
    height, width = np.ptp(column[:, 0]), np.ptp(column[:, 1])
    assert height > 4 * width, (height, width)
    assert np.ptp(diagonal[:, 0]) == pytest.approx(height, rel=0.1)  # the same heatmap height: T rows each
    assert column[:, 1].min() > diagonal[:, 1].max()  # head 1 drawn to the right of head 0


def test_the_pixel_check_sees_a_transposed_record(tmp_path):
    """The negative control: with head 1 transposed (a row instead of a column) the column check fails."""
    record = _record()
    record.layers[0].weights[0, 1] = record.layers[0].weights[0, 1].T.clone()
    row = _groups(_bright(write_png(record, tmp_path / "transposed.png")))[1]
    assert np.ptp(row[:, 0]) < np.ptp(row[:, 1])  # now wide and flat
