"""``multihead train --resume``: the checkpoint decides the settings and the step,
config.json never disagrees with it, a longer schedule says how the learning
rate moves; the default warm-up follows the run's length; a misspelt option
writes nothing."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest
from support.cli import quietly

from multihead.train import TrainConfig, latest_checkpoint, load_training_state, train

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()
TINY = ["--preset", "tiny", "--batch-size", "8", "--eval-batches", "2", "--threads", "1", "--context-length", "32"]


def write_text(path: Path, lines: int = 400) -> Path:
    rng = random.Random(2)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines)) + "\n")
    return path




def snapshot(run: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def saved_config(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def checkpoint_config(run: Path) -> dict:
    return load_training_state(latest_checkpoint(run)).config.to_dict()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 10-step run with the default warm-up (no --warmup)."""
    folder = tmp_path_factory.mktemp("finished")
    data = write_text(folder / "text.txt")
    run = folder / "run"
    rc, out, err = quietly("train", "--data", str(data), *TINY, "--max-steps", "10", "--eval-every", "10",
                           "--checkpoint-every", "5", "--out", str(run))  # fmt: skip
    assert rc == 0, err
    return run


@pytest.fixture
def run(finished, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished, copy)
    config = saved_config(copy)
    config["out"] = str(copy)  # as a run trained here would say
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def test_the_default_warmup_follows_the_run_length(finished):
    # the documented rule, min(40, max_steps // 10): 1 step of a 10-step run
    assert saved_config(finished)["warmup"] == min(40, 10 // 10)
    assert TrainConfig().warmup == 40 and TrainConfig(max_steps=20).warmup == 2 and TrainConfig(max_steps=5).warmup == 0


def test_a_max_steps_below_the_checkpoint_is_refused_and_nothing_changes(run, capsys):
    before = snapshot(run)
    rc, out, err = quietly("train", "--out", str(run), "--resume", "--max-steps", "5")
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    assert f"--max-steps 5 is below step 10 of the checkpoint in {run}" in err
    assert snapshot(run) == before


def test_resuming_at_the_checkpoint_step_trains_nothing_and_says_so(run, capsys):
    before = snapshot(run)
    rc, out, err = quietly("train", "--out", str(run), "--resume")
    assert rc == 0, err
    assert "speed: no step trained (the checkpoint was already at step 10)" in out and "tokens/s" not in out
    assert f"nothing to train: {run} is already at step 10" in err and "done:" not in err
    assert {p: b for p, b in snapshot(run).items() if p.name != "metrics.jsonl"} == {
        p: b for p, b in before.items() if p.name != "metrics.jsonl"
    }


def test_a_longer_run_prints_how_the_learning_rate_moves_and_config_json_follows_the_checkpoint(run, capsys):
    rc, out, err = quietly("train", "--out", str(run), "--resume", "--max-steps", "20", "--log-every", "1")
    assert rc == 0, err
    c = saved_config(run)
    lr, min_lr, warmup = c["lr"], c["min_lr"], c["warmup"]
    before = min_lr  # step 10 is past the end of the 10-step schedule
    after = min_lr + 0.5 * (1 + math.cos(math.pi * (10 - warmup) / (19 - warmup))) * (lr - min_lr)
    assert (
        f"max_steps 10 -> 20 rescales the cosine schedule: the learning rate of step 11 goes from "
        f"{before:.3g} to {after:.3g}"
    ) in err
    logged = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert logged[11]["lr"] == pytest.approx(after, rel=1e-9)
    assert c == checkpoint_config(run) and c["max_steps"] == 20


def test_resume_takes_the_settings_of_the_checkpoint_not_an_edited_config_json(run, capsys):
    (run / "config.json").write_text(json.dumps({**saved_config(run), "lr": 0.5, "max_steps": 3}))
    rc, out, err = quietly("train", "--out", str(run), "--resume", "--max-steps", "12")
    assert rc == 0, err
    assert "(step 12)" in out
    assert saved_config(run) == checkpoint_config(run)
    assert saved_config(run)["lr"] != 0.5 and saved_config(run)["max_steps"] == 12


def test_a_misspelt_kind_option_through_the_library_writes_nothing(tmp_path):
    data = write_text(tmp_path / "text.txt")
    config = TrainConfig(data=str(data), preset="tiny", attention="gqa", attention_options={"num_kv_head": 2},
                         out=str(tmp_path / "run"), threads=1)  # fmt: skip
    with pytest.raises(TypeError, match=r"no option 'num_kv_head' \(did you mean 'num_kv_heads'\?\)"):
        train(config, progress=False)
    assert not (tmp_path / "run").exists()
