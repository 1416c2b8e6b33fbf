"""The legend of the role table: what each score means and the threshold that gives a role."""

from __future__ import annotations

import math

import pytest

from multihead.tools.roles import ROLE_THRESHOLDS, SCORE_MEANINGS, format_legend, role_legend, role_table


def test_legend_covers_every_score_column_in_table_order():
    columns = role_table([])[0][3:]  # after layer, head, roles
    legend = role_legend()
    assert [name for name, _, _ in legend] == columns
    for name, meaning, limit in legend:
        assert meaning == SCORE_MEANINGS[name] and len(meaning) > 20
        assert limit == ROLE_THRESHOLDS.get(name)  # entropy and distance give no role: None


def test_legend_follows_threshold_overrides_and_prints_one_line_per_column():
    legend = dict((name, limit) for name, _, limit in role_legend({"previous": 0.75, "rare": math.inf}))
    assert legend["previous"] == 0.75 and legend["rare"] == math.inf and legend["self"] == ROLE_THRESHOLDS["self"]
    lines = format_legend({"previous": 0.75, "rare": math.inf}).splitlines()
    assert len(lines) == 1 + len(legend)
    assert lines[1].split()[:3] == ["previous", ">=", "0.75"] and lines[1].endswith(SCORE_MEANINGS["previous"])
    assert [line.split()[:2] for line in lines if line.split()[0] in ("rare", "entropy")] == [
        ["rare", "off"],
        ["entropy", "no"],
    ]
    with pytest.raises(ValueError, match="unknown role 'prev' in thresholds"):
        role_legend({"prev": 0.5})
