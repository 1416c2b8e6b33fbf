"""compare's verdict on differences: Student t quantiles, paired and Welch intervals over
seeds, the seeds that would separate two kinds, and the table's marks. scipy (installed
with the test dependencies) is the independent reference."""

import dataclasses
import json
import math
import statistics

import pytest

from multihead.models import GPTConfig
from multihead.train.compare_plan import plan_kind
from multihead.train.compare_report import against_baseline, markdown_table, summarize_kind, write_reports
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
            "val_loss_mean": statistics.fmean(losses), "val_loss_std": 0.0,
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


@pytest.fixture
def few_quantiles(monkeypatch):
    """Fails a test whose seeds search computes more than a few t quantiles: each costs
    time linear in the seeds, so a search that walks from 2 seeds up to thousands takes hours."""
    import multihead.train.compare_stats as module

    calls, original = [], module.t_quantile

    def counted(p, df):
        calls.append(df)
        assert len(calls) <= 20, f"the seeds search computed {len(calls)} t quantiles"
        return original(p, df)

    monkeypatch.setattr(module, "t_quantile", counted)
    return calls


def test_seeds_needed_in_the_hundreds_is_the_fewest_and_found_directly(few_quantiles):
    """A difference far below the spread: the search starts at the normal bound, and is exact."""
    diffs = [0.0004, -0.0036, 0.0044]  # mean 0.0004, spread 0.004
    d = difference({s: 2.47 + x for s, x in enumerate(diffs)}, dict.fromkeys(range(3), 2.47))
    spread, mean, m = statistics.stdev(diffs), statistics.fmean(diffs), d.seeds_needed
    assert 100 < m < 10_000 and len(few_quantiles) <= 20
    assert stats.t.ppf(0.975, m - 1) * spread / math.sqrt(m) < mean
    assert stats.t.ppf(0.975, m - 2) * spread / math.sqrt(m - 1) >= mean


def test_a_difference_no_feasible_number_of_seeds_separates_says_more_than_the_most(few_quantiles):
    diffs = [0.000001, -0.004, 0.004003]
    rows = against_baseline([_row("mha", [2.47, 2.47, 2.47]), _row("gqa", [2.47 + x for x in diffs])])
    assert rows[1]["vs_baseline"]["separated"] is False and rows[1]["vs_baseline"]["seeds_needed"] is None
    assert "gqa more than 10000" in markdown_table(rows)


def test_a_diverged_kind_gets_no_interval_and_the_others_keep_their_verdict():
    nan = float("nan")
    rows = against_baseline([_row("mha", [2.470, 2.472]), _row("diff", [nan, 2.9]), _row("gqa", [2.471, 2.476])])
    by_kind = {r["kind"]: r["vs_baseline"] for r in rows}
    assert by_kind["diff"]["low"] is None and by_kind["diff"]["separated"] is None
    assert by_kind["gqa"]["separated"] is False and by_kind["gqa"]["seeds_needed"] is not None
    table = markdown_table(rows)
    assert "diff: no interval against mha, a loss is not finite" in table
    assert "1 of 2 kinds cannot be told apart from mha" in table and "With one seed" not in table
    clear = markdown_table(against_baseline([_row("mha", [2.470, 2.472]), _row("diff", [nan, 2.9]),
                                             _row("gated", [2.51, 2.512])]))  # fmt: skip
    assert "Every other kind's 95% interval against mha leaves out 0" in clear


def test_a_diverged_run_still_gets_its_report_which_says_so(tmp_path):
    """A run whose loss became NaN (too high a learning rate): compare's reports are written
    as after every kind, the kind has no interval and the report names it."""
    base = GPTConfig.from_preset("tiny", context_length=32, vocab_size=256)

    def runs(losses):
        return [{"seed": s, "val_loss": v, "curve": [[4, v]], "tokens_per_s": 1000.0, "peak_memory_bytes": 2**20}
                for s, v in enumerate(losses)]  # fmt: skip

    rows = [summarize_kind(dataclasses.asdict(plan_kind(base, kind)), runs(losses))
            for kind, losses in (("mha", [2.47, 2.48]), ("mqa", [float("nan"), 2.9]), ("gqa", [2.471, 2.476]))]  # fmt: skip
    assert math.isnan(rows[1]["val_loss_std"]) and rows[0]["val_loss_std"] == pytest.approx(0.01 / math.sqrt(2))
    paths = write_reports(tmp_path, rows, {"steps_per_run": 4})
    report = json.loads(paths["json"].read_text())
    assert report["non_finite"] == ["mqa"] and report["kinds"]["mqa"]["vs_baseline"]["low"] is None
    assert report["kinds"]["gqa"]["vs_baseline"]["separated"] is False
    md = paths["md"].read_text()
    assert "mqa: no interval against mha, a loss is not finite" in md and "1 of 2 kinds cannot be told apart" in md
