"""``multihead compare``: a run whose loss diverged shows as diverged, compare.json is
strict JSON (NaN and infinities as null), and a comparison grows by seeds."""

from __future__ import annotations

import json
import math
from pathlib import Path

from support.training import word_text

from multihead.cli import main

TINY = ["--preset", "tiny", "--context-length", "32", "--batch-size", "8", "--eval-batches", "2", "--threads", "1"]


def _cli(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return (rc, *capsys.readouterr())


def _strict(path: Path):
    """The file read as strict JSON: a NaN or Infinity in it fails the test."""

    def refuse(constant):
        raise AssertionError(f"{path} is not strict JSON: {constant}")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_a_diverged_run_shows_as_diverged_in_strict_json(tmp_path, capsys):
    data, out = word_text(tmp_path / "text.txt"), tmp_path / "cmp"
    rc, stdout, err = _cli(capsys, "compare", "--attention", "mha,mqa", "--seeds", "0,1", *TINY, "--max-steps", "6",
                           "--lr", "1e9", "--min-lr", "1e8", "--warmup", "1", "--grad-clip", "0",
                           "--data", str(data), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    assert "Traceback" not in err and stdout.count("diverged at step") == 4
    report = _strict(out / "compare.json")
    assert report["non_finite"] == ["mha", "mqa"]
    for kind in ("mha", "mqa"):
        row = report["kinds"][kind]
        assert row["val_loss"] == [None, None] and row["val_loss_mean"] is None
        assert [d["seed"] for d in row["diverged"]] == [0, 1]
        for d in row["diverged"]:
            run = out / f"{kind}-seed{d['seed']}"
            outcome = json.loads((run / "diverged.json").read_text())
            assert (d["step"], d["which"], d["value"]) == (outcome["step"], outcome["which"], outcome["value"])
            assert 1 <= d["step"] <= 6 and not math.isfinite(float(d["value"]))
            _strict(run / "compare-result.json")
        assert row["vs_baseline"]["low"] is None
    table = (out / "compare.md").read_text()
    assert "(diverged: seed 0 at step" in table and "no interval against mha, a loss is not finite" in table
    # the same command again keeps the diverged runs: nothing is trained twice
    rc, stdout, err = _cli(capsys, "compare", "--attention", "mha,mqa", "--seeds", "0,1", *TINY, "--max-steps", "6",
                           "--lr", "1e9", "--min-lr", "1e8", "--warmup", "1", "--grad-clip", "0",
                           "--data", str(data), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    assert stdout.count("kept from an earlier run") == 4 and _strict(out / "compare.json")["non_finite"] == ["mha", "mqa"]


def test_more_seeds_grow_the_comparison_and_a_changed_setting_is_refused(tmp_path, capsys):
    data, out = word_text(tmp_path / "text.txt"), tmp_path / "cmp"
    first = ["compare", "--quick", "--attention", "mha", "--data", str(data), "--out", str(out)]
    rc, stdout, err = _cli(capsys, *first, "--seeds", "0,1")
    assert rc == 0, err
    state = json.loads((out / "compare-state.json").read_text())
    before = {s: (out / f"mha-seed{s}" / "compare-result.json").read_text() for s in (0, 1)}
    rc, stdout, err = _cli(capsys, *first, "--seeds", "0,1,2")
    assert rc == 0, err
    assert stdout.count("kept from an earlier run") == 2 and "[3/3] mha seed 2: val loss" in stdout
    assert {s: (out / f"mha-seed{s}" / "compare-result.json").read_text() for s in (0, 1)} == before  # not retrained
    report = _strict(out / "compare.json")
    row = report["kinds"]["mha"]
    assert report["seeds"] == row["seeds"] == [0, 1, 2] and len(row["val_loss"]) == 3
    # the minutes are those of all three runs, whichever call trained them; the date spans both calls
    runs = [json.loads((out / f"mha-seed{s}" / "compare-result.json").read_text()) for s in (0, 1, 2)]
    assert report["minutes"] == round(sum(r["seconds"] for r in runs) / 60, 2)
    assert report["date"].startswith(state["started"])
    assert json.loads((out / "compare-state.json").read_text())["started"] == state["started"]
    # a changed setting is still another comparison
    rc, stdout, err = _cli(capsys, *first, "--seeds", "0,1,2,3", "--lr", "0.01")
    assert rc == 2 and len(err.splitlines()) == 1 and f"--out {out} holds another comparison (train: " in err
    assert "'lr': 0.01" in err and "seeds:" not in err.partition("; continue")[0]
