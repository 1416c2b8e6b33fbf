"""``multihead compare``: a quick real comparison writes its table, JSON and plot;
mistakes end with one line."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from multihead.cli import main
from multihead.models.checkpoint import load_checkpoint

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()


def _text(path: Path) -> Path:
    rng = random.Random(0)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(600)) + "\n")
    return path


def _cli(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return (rc, *capsys.readouterr())


def test_quick_comparison_writes_table_json_and_plot(tmp_path, capsys):
    data, out = _text(tmp_path / "text.txt"), tmp_path / "cmp"
    rc, stdout, err = _cli(capsys, "compare", "--quick", "--attention", "mha,mqa", "--seeds", "0,1",
                           "--data", str(data), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    assert "[4/4] mqa seed 1" in stdout and f"wrote png  {out / 'compare.png'}" in stdout
    report = json.loads((out / "compare.json").read_text())
    assert report["steps_per_run"] == 4 and report["preset"] == "tiny" and report["seeds"] == [0, 1]
    for kind in ("mha", "mqa"):
        row = report["kinds"][kind]
        assert row["seeds"] == [0, 1] and len(row["val_loss"]) == 2 and row["val_loss_std"] >= 0
        assert row["tokens_per_s"] > 0 and row["peak_memory_bytes"] > 2**20
        assert set(row["curves"]) == {"0", "1"} and row["curves"]["0"][-1][0] == 4
        metrics = (out / f"{kind}-seed1" / "metrics.jsonl").read_text().splitlines()
        assert json.loads(metrics[-1])["val_loss"] == row["val_loss"][1]
    assert report["kinds"]["mqa"]["kv_cache_bytes_per_token"] * 4 == report["kinds"]["mha"]["kv_cache_bytes_per_token"]
    # MQA drops key/value weights: its trained model has the wider MLP the plan chose
    model = load_checkpoint(out / "mqa-seed0" / "checkpoints" / "step-000004" / "model.safetensors")
    mqa = report["kinds"]["mqa"]
    assert mqa["mlp_dim"] > 4 * 64 and model.blocks[0].mlp.fc.out_features == mqa["mlp_dim"]
    assert model.num_parameters() == mqa["parameters"]
    table = (out / "compare.md").read_text()
    assert table.count("\n| m") == 2 and "± " in table and "](compare.png)" in table
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--attention", "mha,linear"], "unknown attention kind 'linear'"),
        (["--seeds", "0,x"], "--seeds must be comma-separated integers"),
        (["--seeds", "1,1"], "--seeds must be distinct"),
        (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
        (["--preset", "huge"], "unknown GPT preset preset='huge'"),
    ],
)
def test_mistakes_are_one_line(tmp_path, capsys, argv, match):
    rc, stdout, err = _cli(capsys, "compare", "--quick", "--out", str(tmp_path / "c"), *argv)
    assert rc == 2 and stdout == "" and len(err.splitlines()) == 1, err
    assert err.startswith("multihead compare: error: ") and match in err
    assert not (tmp_path / "c" / "compare.json").exists()
