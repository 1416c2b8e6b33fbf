"""``multihead heads RUN_DIR``: the PNG of a --track-heads run and the table of the heads that
reached the threshold (with the step); a run dir it cannot read is one line and writes nothing."""

from __future__ import annotations

import json
import os
import signal

import pytest
from support.cli import quietly

from multihead.train.head_series import read_head_series, rises

ROLES = ("previous_token", "duplicate_token", "induction")
# induction of layer 1 head 0 over the scored steps 10, 20, 30, 40; the other heads stay low
INDUCTION_10 = [0.05, 0.08, 0.55, 0.71]


def tracked_line(step: int, k: int) -> dict:
    low = [[0.05, 0.06], [0.04, 0.07]]
    scores = {role: [row[:] for row in low] for role in ROLES}
    scores["induction"][1][0] = INDUCTION_10[k]
    scores["previous_token"][0][1] = 0.9  # a head that has its role from the first scored step
    scores["previous_token"][1][1] = None  # a pruned layer's missing head
    heads = {"length": 32, "batch": 8, "seed": 0, "layers": ["blocks.0.attn", "blocks.1.attn"], "scores": scores,
             "chance": {"previous_token": 0.059, "duplicate_token": 0.021, "induction": 0.021},
             "thresholds": {"previous_token": 0.4, "duplicate_token": 0.4, "induction": 0.5}}  # fmt: skip
    return {"step": step, "train_loss": 3.0 - k / 10, "val_loss": 3.1 - k / 10, "heads": heads}


@pytest.fixture
def run(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    lines = []
    for k, step in enumerate((10, 20, 30, 40)):
        lines += [json.dumps({"step": step - 5, "train_loss": 3.05 - k / 10}), json.dumps(tracked_line(step, k))]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n" + '{"step": 45, "train_lo')  # a line cut by a kill
    return folder


def test_writes_the_png_and_prints_the_heads_that_reached_the_threshold(run):
    rc, out, err = quietly("heads", str(run))
    assert rc == 0, err
    png = run / "heads.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    lines = out.splitlines()
    assert lines[0] == (f"{run}: heads scored at 4 evaluation(s), steps 10..40, on 8 x 2·32 repeated random tokens "
                        "(chance: previous_token 0.059, duplicate_token 0.021, induction 0.021)")  # fmt: skip
    rows = [line.split() for line in lines if line.split()[0] in ROLES and "no" not in line.split()]
    assert rows == [["previous_token", "0", "1", "0.4", "10", "-", "->", "0.900", "0.900", "held"],
                    ["induction", "1", "0", "0.5", "30", "0.080", "->", "0.550", "0.710", "held"]]  # fmt: skip
    assert "duplicate_token: no head reached 0.4 (best at step 40: 0.070)" in lines
    assert lines[-1] == f"wrote {png}" and not [p for p in run.iterdir() if p.name.startswith(".")]


def test_threshold_and_out(run, tmp_path):
    rc, out, err = quietly("heads", str(run), "--threshold", "0.6", "--out", str(tmp_path / "figs" / "h.png"))
    assert rc == 0, err
    assert (tmp_path / "figs" / "h.png").is_file() and not (run / "heads.png").exists()
    assert [r.step for r in rises(read_head_series(run), 0.6) if r.role == "induction"] == [40]
    assert "induction" in out and " 40 " in out and "0.550 -> 0.710" in out
    rc, out, err = quietly("heads", str(run), "--threshold", "0.075")  # one for all: step 20's 0.08 reaches it
    assert [line.split()[:5] for line in out.splitlines() if line.startswith("induction ")] == [["induction", "1", "0", "0.075", "20"]]


def test_a_head_that_crossed_once_and_fell_back_is_marked(run):
    """catches: a one-evaluation blip listed like a formed head (its row must say "fell")."""
    rc, out, err = quietly("heads", str(run), "--threshold", "0.6")  # 0.71 at the end: held
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("induction ")] == ["held"]
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    tracked = [line for line in lines if "heads" in line]
    for line, score in zip(tracked, (0.05, 0.62, 0.2, 0.1)):  # reaches 0.5 at step 20, ends at 0.1
        line["heads"]["scores"]["induction"][1][0] = score
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rc, out, err = quietly("heads", str(run))
    assert rc == 0, err
    rows = [line.split() for line in out.splitlines() if line.startswith("induction ")]
    assert rows == [["induction", "1", "0", "0.5", "20", "0.050", "->", "0.620", "0.100", "fell"]]


def test_a_run_that_recorded_no_thresholds_uses_0_4(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    for line in lines:
        if "heads" in line:
            del line["heads"]["thresholds"], line["heads"]["chance"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rc, out, err = quietly("heads", str(run))
    assert rc == 0, err
    assert out.splitlines()[0].endswith("repeated random tokens")
    assert [line.split()[:5] for line in out.splitlines() if line.startswith("induction ")] == [["induction", "1", "0", "0.4", "30"]]


def test_a_trained_run(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("to be or not to be, that is the question\n" * 200)
    run = tmp_path / "run"
    rc, _, err = quietly("train", "--data", str(data), "--preset", "tiny", "--context-length", "16", "--batch-size", "4",
                         "--eval-batches", "1", "--threads", "1", "--max-steps", "4", "--eval-every", "2",
                         "--track-heads", "--out", str(run))  # fmt: skip
    assert rc == 0, err
    rc, out, err = quietly("heads", str(run), "--threshold", "0.01")  # every head: an even spread is above it
    assert rc == 0, err
    assert out.splitlines()[0].startswith(f"{run}: heads scored at 2 evaluation(s), steps 2..4, on 8 x 2·8")
    assert sum(line.startswith("previous_token ") for line in out.splitlines()) == 8  # 2 layers x 4 heads
    assert (run / "heads.png").is_file()


def test_mistakes_are_one_line_and_write_nothing(tmp_path, run):
    untracked = tmp_path / "untracked"
    untracked.mkdir()
    (untracked / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 2.0, "val_loss": 2.1}) + "\n")
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(tmp_path / "nowhere")], "no such folder"),
        ([str(tmp_path / "empty")], "is not a multihead train run directory: it has no metrics.jsonl"),
        ([str(untracked)], f"has no tracked heads (no evaluation line of its metrics.jsonl has \"heads\"): train it "
                           f"with --track-heads, or resume it with: multihead train --out {untracked} --resume --track-heads"),
        ([str(run), "--threshold", "0"], "--threshold must be in (0, 1], got 0.0"),
        ([str(run), "--threshold", "nan"], "--threshold must be in (0, 1]"),
        ([str(run), "--out", str(tmp_path)], "is a folder (give the PNG's file name)"),
    ]  # fmt: skip
    for argv, message in cases:
        rc, out, err = quietly("heads", *argv)
        assert rc == 2 and out == "" and err.count("\n") == 1, (argv, err)
        assert err.startswith("multihead heads: error: ") and message in err, (argv, err)
    assert not (run / "heads.png").exists() and not (untracked / "heads.png").exists()


def test_ctrl_c_while_drawing_leaves_no_png(run, monkeypatch):
    import multihead.train.head_series as head_series

    def interrupted(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return b"never written"

    monkeypatch.setattr(head_series, "plot_heads", interrupted)
    rc, out, err = quietly("heads", str(run))
    assert rc == 130 and out == ""
    assert err == f"multihead heads: interrupted by SIGINT; {run / 'heads.png'} was not written (nothing was left behind)\n"
    assert sorted(p.name for p in run.iterdir()) == ["metrics.jsonl"]


def test_a_role_missing_from_some_lines_is_blank_there_and_bad_tables_are_one_line(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()[:-1]]
    for line in lines[:4]:  # the first two scored steps lack induction (tracked before it existed)
        line.get("heads", {}).get("scores", {}).pop("induction", None)
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    series = read_head_series(run)
    assert list(series.scores) == list(ROLES) and series.scores["induction"].shape == (4, 2, 2)
    assert [(r.step, r.before) for r in rises(series) if r.role == "induction"] == [(30, None)]  # nothing scored before
    lines[-1]["heads"]["scores"]["induction"] = [[0.1, 0.2, 0.3]]  # another shape
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rc, out, err = quietly("heads", str(run))
    assert rc == 2 and err.count("\n") == 1
    assert "the tracked 'induction' scores are not [layers][heads] tables of one shape" in err
