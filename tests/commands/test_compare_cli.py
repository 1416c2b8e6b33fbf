"""``multihead compare``: a quick real comparison writes its table, JSON and plot;
mistakes end with one line."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.training import word_text

from multihead.cli import main
from multihead.models.checkpoint import load_checkpoint
from multihead.train.compare_runs import save_state


def _cli(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return (rc, *capsys.readouterr())


def test_quick_comparison_writes_table_json_and_plot(tmp_path, capsys):
    data, out = word_text(tmp_path / "text.txt"), tmp_path / "cmp"
    rc, stdout, err = _cli(capsys, "compare", "--quick", "--attention", "mha,mqa", "--seeds", "0,1",
                           "--data", str(data), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    assert "[4/4] mqa seed 1" in stdout and f"wrote png  {out / 'compare.png'}" in stdout
    assert "a smoke test: 4 steps" in stdout
    report = json.loads((out / "compare.json").read_text())
    assert report["steps_per_run"] == 4 and report["preset"] == "tiny" and report["seeds"] == [0, 1]
    assert report["smoke_test"] is True and report["kinds_finished"] == "2 of 2"
    for kind in ("mha", "mqa"):
        row = report["kinds"][kind]
        assert row["seeds"] == [0, 1] and len(row["val_loss"]) == 2 and row["val_loss_std"] >= 0
        assert "tokens_per_s" not in row and row["peak_memory_bytes"] > 2**20  # 4 steps measure no speed
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
    assert "**A smoke test**" in table and "tokens/s" not in table
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--attention", "mha,linear"], "unknown attention kind 'linear'"),
        (["--seeds", "0,x"], "--seeds must be comma-separated integers"),
        (["--seeds", "1,1"], "--seeds must be distinct"),
        (["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
        (["--preset", "huge"], "unknown GPT preset preset='huge'"),
        (["--attention", "mha", "--attention-option", "gqa:num_kv_heads=1"], "'gqa' is not one of the compared kinds ['mha']"),
        (["--attention", "gqa", "--attention-option", "num_kv_heads=1"], "expected KIND:K=V (e.g. gqa:num_kv_heads=1)"),
        (["--attention", "gqa", "--attention-option", "gqa:num_kv_heads=3"], "num_kv_heads"),
        (["--batch-size", "x"], "argument --batch-size: invalid int value: 'x'; see 'multihead compare --help'"),
    ],
)
def test_mistakes_are_one_line(tmp_path, capsys, argv, match):
    rc, stdout, err = _cli(capsys, "compare", "--quick", "--out", str(tmp_path / "c"), *argv)
    assert rc == 2 and stdout == "" and len(err.splitlines()) == 1, err
    assert err.startswith("multihead compare: error: ") and match in err
    assert not (tmp_path / "c" / "compare.json").exists()


def _running(spec: Path) -> list[int]:
    """Processes whose command line names ``spec`` (a run's compare-run.json): that run's child."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(spec).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_sigterm_keeps_finished_runs_and_the_same_command_continues(tmp_path, capsys):
    data, out = word_text(tmp_path / "text.txt"), tmp_path / "cmp"
    argv = ["compare", "--quick", "--attention", "mha,gqa", "--attention-option", "gqa:num_kv_heads=1",
            "--max-steps", "2", "--data", str(data), "--out", str(out)]  # fmt: skip
    with open(tmp_path / "stderr", "w") as err:
        parent = subprocess.Popen([sys.executable, "-m", "multihead", *argv], stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 300
        while not (out / "gqa-seed0.log").exists() and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        parent.send_signal(signal.SIGTERM)  # the second run is starting
        assert parent.wait(120) == 143
    lines = (tmp_path / "stderr").read_text().splitlines()
    assert any(line.startswith("[1/2] mha seed 0 2/2 | loss ") for line in lines), lines  # kind, step, ETA
    assert lines[-1] == (f"multihead compare: stopped by SIGTERM; kept the 1 finished run(s) (mha-seed0) in {out}; "
                         f"continue with: multihead {' '.join(argv)}")  # fmt: skip
    assert _running(out / "gqa-seed0" / "compare-run.json") == []  # the running child was stopped
    report = json.loads((out / "compare.json").read_text())
    assert list(report["kinds"]) == ["mha"] and report["kinds_finished"] == "1 of 2"
    assert "step 2/2 | loss" in (out / "mha-seed0.log").read_text()  # the run's own output

    rc, stdout, stderr = _cli(capsys, *argv)  # the same command continues
    assert rc == 0, stderr
    assert "[1/2] mha seed 0: val loss" in stdout and "(kept from an earlier run)" in stdout
    assert "[2/2] gqa seed 0: val loss" in stdout and "[2/2] gqa seed 0 2/2 | loss " in stderr
    report = json.loads((out / "compare.json").read_text())
    assert sorted(report["kinds"]) == ["gqa", "mha"] and report["kinds"]["gqa"]["kv_cache_bytes_per_token"] * 4 == (
        report["kinds"]["mha"]["kv_cache_bytes_per_token"])  # fmt: skip
    # --attention-option gqa:... reached the gqa run only
    assert json.loads((out / "gqa-seed0" / "config.json").read_text())["attention_options"] == {"num_kv_heads": 1}
    assert json.loads((out / "mha-seed0" / "config.json").read_text())["attention_options"] == {}
    # one tokenized copy of the data: every run's token files are links to it
    for split in ("train.bin", "val.bin"):
        shared = (out / "data" / split).stat()
        assert shared.st_nlink == 3
        assert all((out / run / "data" / split).stat().st_ino == shared.st_ino for run in ("mha-seed0", "gqa-seed0"))


def test_another_comparison_in_the_same_out_is_refused(tmp_path, capsys):
    out = tmp_path / "cmp"
    save_state(out, {"kinds": ["mha"], "seeds": [0], "max_steps": 4}, 4, "multihead compare --max-steps 4", "2026-01-01 00:00 UTC")
    rc, stdout, err = _cli(capsys, "compare", "--quick", "--attention", "mha", "--max-steps", "3", "--out", str(out))
    assert rc == 2 and stdout == "" and len(err.splitlines()) == 1, err
    assert f"--out {out} holds another comparison" in err and "; budget_minutes: unset there, 18.0 here; " in err and "max_steps: 4 there, 3 here" in err
    assert "continue it with its own flags (multihead compare --max-steps 4)" in err


def test_help_states_the_comparison_defaults(capsys):
    rc, stdout, _ = _cli(capsys, "compare", "--help")
    text = " ".join(stdout.split()).partition("options:")[2]
    assert rc == 0 and "as in multihead train" not in text
    for flag, default in (("--batch-size B", "16"), ("--lr LR", "0.001"), ("--preset NAME", "mini"),
                          ("--context-length T", "128"), ("--warmup N", "20, at most a tenth of the steps"),
                          ("--seeds S,S", "0,1"), ("--budget-minutes M", "18.0")):  # fmt: skip
        assert re.search(re.escape(flag) + r"(?:(?! --[a-z]).)*?\(default " + re.escape(default), text), (flag, default)
    assert "--attention-option KIND:K=V" in text and "--mlp-dim" not in text and "--shard" not in text


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_ctrl_c_before_any_run_finished_says_so_and_exits_130(tmp_path):
    data, out = word_text(tmp_path / "text.txt"), tmp_path / "cmp"
    argv = ["compare", "--quick", "--attention", "mha", "--data", str(data), "--out", str(out)]
    parent = subprocess.Popen([sys.executable, "-m", "multihead", *argv], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while not (out / "mha-seed0.log").exists() and parent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    parent.send_signal(signal.SIGINT)
    _, err = parent.communicate(timeout=120)
    assert parent.returncode == 130, err
    assert err.splitlines()[-1] == (f"multihead compare: stopped by SIGINT; no run had finished in {out}; "
                                    f"continue with: multihead {' '.join(argv)}")  # fmt: skip
    assert "Traceback" not in err and _running(out / "mha-seed0" / "compare-run.json") == []
    assert not (out / "compare.json").exists() and not (out / "mha-seed0" / "compare-result.json").exists()
