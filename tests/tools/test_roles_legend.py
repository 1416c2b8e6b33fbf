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
    rule = [line for line in lines if not line.startswith("  ")]
    columns = [line for line in lines if line.startswith("  ")]
    assert lines[: len(rule)] == rule and len(columns) == len(legend)  # the rule, then one line per column
    assert columns[0].split()[:3] == ["previous", ">=", "0.75"] and columns[0].endswith(SCORE_MEANINGS["previous"])
    assert [line.split()[:2] for line in columns if line.split()[0] in ("rare", "entropy")] == [
        ["rare", "off"],
        ["entropy", "no"],
    ]
    with pytest.raises(ValueError, match="unknown role 'prev' in thresholds"):
        role_legend({"prev": 0.5})


def test_legend_states_the_margin_and_both_marks_and_explains_the_masses():
    from multihead.tools.roles import NO_ROLE, ROLE_MARGIN

    text = " ".join(format_legend().split())
    assert f"beats chance by {ROLE_MARGIN:.2f}" in text
    assert "'-' in a score column: not measurable" in text and f"'{NO_ROLE}' in the roles column: no role" in text
    assert "_mass" not in text  # the table has no *_mass column, so neither has its legend
    masses = format_legend(masses=True)
    for name in ("previous_mass", "next_mass", "self_mass"):
        assert f"  {name}" in masses and SCORE_MEANINGS[name] in masses
    assert [n for n, _, _ in role_legend(masses=True)][-3:] == ["previous_mass", "next_mass", "self_mass"]
    assert role_table([])[0][2] == "roles" and NO_ROLE != "-"
