"""``multihead train`` stops on a NaN or infinite loss: one line, exit 3, and the
latest checkpoint stays the last good one."""

from __future__ import annotations

import json
import math

from multihead.cli import main
from multihead.models.run_dirs import latest_checkpoint
from multihead.train import load_training_state

TEXT = "".join(f"the quick brown fox {i % 7} jumps over the lazy dog.\n" for i in range(300))
TINY = ["--preset", "tiny", "--batch-size", "4", "--eval-batches", "2", "--threads", "1", "--context-length", "16"]


def _cli(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    return (rc, *capsys.readouterr())


def test_a_diverged_loss_stops_with_one_line_and_keeps_the_good_checkpoint(tmp_path, capsys):
    data, run = tmp_path / "text.txt", tmp_path / "run"
    data.write_text(TEXT)
    # at lr 1e9 the first update blows the weights up: a loss is NaN or infinite within a few steps
    rc, out, err = _cli(capsys, "train", "--data", str(data), *TINY, "--max-steps", "10", "--lr", "1e9",
                        "--min-lr", "1e8", "--warmup", "0", "--grad-clip", "0", "--log-every", "1",
                        "--eval-every", "10", "--checkpoint-every", "1", "--out", str(run))  # fmt: skip
    assert rc == 3
    lines = [line for line in err.splitlines() if line.startswith("multihead train:")]
    assert len(lines) == 1 and "Traceback" not in err
    outcome = json.loads((run / "diverged.json").read_text())
    step = outcome["step"]
    assert 1 < step < 10 and f"at step {step}" in lines[0] and "lower --lr" in lines[0]
    assert not math.isfinite(float(outcome["value"]))
    # nothing of the diverged step was written: the checkpoints end one step before, with finite weights
    state = load_training_state(latest_checkpoint(run))
    assert state.step == step - 1 and f"{latest_checkpoint(run)} is the last good checkpoint" in lines[0]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == step - 1 and all(math.isfinite(m["train_loss"]) for m in metrics)
    from safetensors.torch import load_file

    weights = load_file(str(latest_checkpoint(run) / "model.safetensors"))
    assert all(t.isfinite().all() for t in weights.values())
    # a resume that trains again (here: nothing left up to the good checkpoint) drops the old record
    rc, out, err = _cli(capsys, "train", "--out", str(run), "--resume", "--max-steps", str(step - 1))
    assert rc == 0, err
    assert not (run / "diverged.json").exists()
