"""compare's verdict on differences: Student t quantiles, paired and Welch intervals over
seeds, the seeds that would separate two kinds, and the table's marks. scipy (installed
with the test dependencies) is the independent reference."""

import math
import statistics

import pytest

from multihead.train.compare_report import against_baseline, markdown_table
from multihead.train.compare_stats import difference, t_quantile

stats = pytest.importorskip("scipy.stats")


@pytest.mark.parametrize("df", [1, 2, 3, 4, 5, 6, 7, 10, 11, 29, 30, 57])
@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995])
def test_t_quantile_equals_scipy(df, p):
    assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), rel=1e-9)


def test_t_quantile_refuses_what_it_does_not_compute():
    for p, df in ((0.4, 3), (1.0, 3), (0.9, 0)):
        with pytest.raises(ValueError, match="t_quantile"):
            t_quantile(p, df)


def test_paired_interval_equals_scipys_paired_t_interval():
    kind = {0: 2.471, 1: 2.475, 2: 2.469, 3: 2.480}
    base = {0: 2.468, 1: 2.470, 2: 2.468, 3: 2.471}
    d = difference(kind, base)
    ci = stats.ttest_rel(list(kind.values()), list(base.values())).confidence_interval(0.95)
    assert d.paired and (d.low, d.high) == (pytest.approx(ci.low, abs=1e-12), pytest.approx(ci.high, abs=1e-12))
    assert d.mean == pytest.approx(statistics.fmean(kind.values()) - statistics.fmean(base.values()))
    assert d.separated == bool(ci.low > 0 or ci.high < 0)


def test_welch_interval_holds_scipys_and_is_not_much_wider():
    """Other seeds on each side: Welch's interval, degrees of freedom rounded down (wider)."""
    kind, base = {0: 2.50, 1: 2.52, 2: 2.49}, {5: 2.47, 6: 2.48, 7: 2.471, 8: 2.46}
    d = difference(kind, base)
    ci = stats.ttest_ind(list(kind.values()), list(base.values()), equal_var=False).confidence_interval(0.95)
    assert not d.paired
    assert d.low <= ci.low + 1e-12 and d.high >= ci.high - 1e-12
    assert (d.high - d.low) <= 1.5 * (ci.high - ci.low)


def test_seeds_needed_is_the_fewest_that_separate_at_the_observed_spread():
    kind, base = {0: 2.471, 1: 2.476}, {0: 2.470, 1: 2.472}  # differences 0.001 and 0.004
    d = difference(kind, base)
    assert d.separated is False and d.low < 0 < d.high
    spread, mean, m = statistics.stdev([0.001, 0.004]), 0.0025, d.seeds_needed
    assert stats.t.ppf(0.975, m - 1) * spread / math.sqrt(m) < mean  # m seeds separate them
    assert stats.t.ppf(0.975, m - 2) * spread / math.sqrt(m - 1) >= mean  # m - 1 do not


def test_a_clear_difference_is_separated_and_one_seed_gives_no_interval():
    assert difference({0: 2.6, 1: 2.61, 2: 2.6}, {0: 2.4, 1: 2.41, 2: 2.405}).separated is True
    one = difference({0: 2.6}, {0: 2.4})
    assert one.low is None and one.separated is None and one.mean == pytest.approx(0.2)


def _row(kind, losses):
    return {"kind": kind, "seeds": list(range(len(losses))), "val_loss": losses,
            "val_loss_mean": statistics.fmean(losses), "val_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0,
            "parameters": 1000, "mlp_dim": None, "prefill_flops_per_token": 1.0, "decode_flops_per_token": 1.0,
            "kv_cache_bytes_per_token": 64, "peak_memory_bytes": 2**20}  # fmt: skip


def test_the_table_marks_kinds_it_cannot_separate_from_mha_and_says_so():
    rows = against_baseline([_row("gqa", [2.471, 2.476]), _row("mha", [2.470, 2.472]), _row("gated", [2.51, 2.512])])
    assert {r["vs_baseline"]["baseline"] for r in rows} == {"mha"}
    table = markdown_table(rows)
    lines = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ")}
    assert "vs mha (95% CI)" in table
    assert "≈" in lines["gqa"] and "≈" not in lines["gated"]
    assert lines["mha"].split("|")[3].strip() == "baseline"  # not a zero-width interval against itself
    assert "1 of 2 kinds cannot be told apart from mha" in table and "gqa " in table.split("≈:")[1]


def test_one_seed_tables_say_there_is_no_interval():
    table = markdown_table(against_baseline([_row("mha", [2.47]), _row("gqa", [2.48])]))
    assert "With one seed there is no interval" in table and "≈" not in table
