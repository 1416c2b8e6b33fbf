"""The measuring parts of benchmarks/minilm_pruning.py against plain Python loops."""

import math

import pytest
import torch

from benchmarks.minilm_pruning import (  # the repository root is on pytest's pythonpath
    head_table,
    neighbour_agreement,
    next_line_pairs,
    pruning_order,
    speed_up,
    split_works,
    sweep_tables,
    work_lines,
)


def _loop_neighbours(rows: list[list[float]], i: int, k: int) -> set[int]:
    def cos(a, b):
        dot = sum(x * y for x, y in zip(a, b))
        return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    others = sorted((j for j in range(len(rows)) if j != i), key=lambda j: -cos(rows[i], rows[j]))
    return set(others[:k])


def test_neighbour_agreement_matches_a_loop():
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(23, 6, generator=g)
    pruned = reference + 0.7 * torch.randn(23, 6, generator=g)
    k = 4
    ref_rows, pruned_rows = reference.tolist(), pruned.tolist()
    want = sum(len(_loop_neighbours(ref_rows, i, k) & _loop_neighbours(pruned_rows, i, k)) / k for i in range(23)) / 23
    got = neighbour_agreement(reference, pruned, k=k)
    assert 0.0 < want < 1.0  # the noise changes some neighbourhoods, not all
    assert got == pytest.approx(want, abs=1e-12)
    # the same rows on both sides: the same operations on the same tensors, so exactly 1
    assert neighbour_agreement(reference, reference.clone(), k=k) == 1.0


def test_neighbour_agreement_refuses_k_out_of_range():
    x = torch.randn(5, 3)
    with pytest.raises(ValueError, match=r"k=5 must be in \[1, 4\] for 5 rows"):
        neighbour_agreement(x, x, k=5)


def test_pruning_order_is_a_global_ascending_ranking():
    scores = torch.tensor([[0.5, 0.1, 0.9], [0.3, 0.1, 0.7]], dtype=torch.float64)
    want = sorted((float(scores[i, h]), i, h) for i in range(2) for h in range(3))  # ties: lower index first
    order = pruning_order(scores)
    assert order == [(i, h) for _, i, h in want]
    assert head_table(order, 3) == {0: [1], 1: [1, 0]}
    assert head_table(order, 0) == {}


def test_lines_pairs_and_work_split():
    text = "HAMLET.\nTo be, or not to be, that is\nthe question: whether tis nobler in the mind\n\nshort line\n"
    lines = work_lines(text, 5)
    assert lines == [None, "To be, or not to be, that is", "the question: whether tis nobler in the mind",
                     None, None, None]  # fmt: skip
    assert next_line_pairs(lines) == [("To be, or not to be, that is", "the question: whether tis nobler in the mind")]
    calib, held = split_works(["c", "a", "d", "b", "e"])
    assert (calib, held) == (["a", "c", "e"], ["b", "d"])


def _loop_removals(scores: list[list[float]], count: int) -> dict[int, list[int]]:
    """Lowest score first (ties: lower layer, then lower head), never a layer's last head."""
    left = [len(row) for row in scores]
    table: dict[int, list[int]] = {}
    for _, i, h in sorted((s, i, h) for i, row in enumerate(scores) for h, s in enumerate(row)):
        if count == 0:
            break
        if left[i] > 1:
            left[i] -= 1
            table.setdefault(i, []).append(h)
            count -= 1
    return table


def test_sweep_tables_remove_int_share_and_keep_a_head_per_layer():
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(3, 4, generator=g, dtype=torch.float64)
    scores[0] -= 1.0  # layer 0 ranks first: the sweep must stop at its last head
    fractions = (0.0, 0.25, 0.5, 0.75)
    tables = sweep_tables(scores, fractions)
    assert [count for count, _ in tables] == [int(12 * p) for p in fractions] == [0, 3, 6, 9]
    for count, table in tables:
        assert table == _loop_removals(scores.tolist(), count)
        assert sum(len(hs) for hs in table.values()) == count
        assert all(len(table.get(i, [])) <= 3 for i in range(3))
    assert len(tables[-1][1][0]) == 3  # layer 0 keeps exactly one head at 75 %


def test_speed_up_is_the_median_of_per_round_ratios():
    assert speed_up([2.0, 4.0, 6.0], [1.0, 1.0, 3.0]) == 2.0  # ratios 2, 4, 2
    assert speed_up([3.0, 1.0], [1.0, 1.0]) == 2.0  # even count: mean of the middle two (3 and 1)
    with pytest.raises(ValueError, match="got 2 and 1"):
        speed_up([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="got 0 and 0"):
        speed_up([], [])
