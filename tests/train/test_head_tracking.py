"""``--track-heads``: every evaluation line of metrics.jsonl carries the heads' causal-role
scores of the model at that step; tracking changes no step; a resume continues the series
(and may switch tracking on); what cannot be tracked is one line, before anything is written."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support.cli import quietly
from support.training import latest, tiny_config

from multihead.tools.capture import capture
from multihead.tools.causal_roles import CAUSAL_ROLES
from multihead.train import TrainConfig, train
from multihead.train.batches import read_tokens

TEXT = "".join(f"to be or not to be, line {i % 5}: that is the question.\n" for i in range(300))
SMALL = dict(batch_size=4, max_steps=6, eval_every=3, log_every=1, checkpoint_every=3, warmup=1)


def metrics(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def roles_by_hand(model, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each role's [L, H] score written out from the captured weights [B, H, 2n, 2n]."""
    n = tokens.shape[1] // 2
    with torch.no_grad(), capture(model) as record:
        model(tokens)
    out = {"previous_token": [], "duplicate_token": [], "induction": []}
    for entry in record.layers:
        w = entry.weights
        out["previous_token"].append(torch.stack([w[:, :, i, i - 1] for i in range(1, 2 * n)], -1).mean((0, 2)))
        out["duplicate_token"].append(torch.stack([w[:, :, i, i - n] for i in range(n, 2 * n)], -1).mean((0, 2)))
        out["induction"].append(torch.stack([w[:, :, i, i - n + 1] for i in range(n, 2 * n)], -1).mean((0, 2)))
    return {role: torch.stack(rows) for role, rows in out.items()}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tracked")
    config = tiny_config(folder, TEXT, track_heads=True, **SMALL)
    train(config, progress=False)
    return folder / "run"


def test_every_evaluation_line_holds_the_scores_of_that_steps_model(tracked):
    rows = metrics(tracked)
    with_heads = [r["step"] for r in rows if "heads" in r]
    assert with_heads == [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    for row in rows:
        if "heads" not in row:
            continue
        heads = row["heads"]
        assert heads["length"] == 8 and heads["batch"] == 8 and heads["layers"] == ["blocks.0.attn", "blocks.1.attn"]
        assert set(heads["scores"]) >= set(CAUSAL_ROLES) and set(heads["thresholds"]) == set(heads["scores"])
        for role, table in heads["scores"].items():
            low = -1 if role == "copying" else 0  # the OV circuit's score is in [-1, 1]
            assert len(table) == 2 and all(len(r) == 4 and all(low <= v <= 1 for v in r) for r in table)
            assert heads["chance"][role] < heads["thresholds"][role]
    # the last line against the saved model of step 6, scored here from its captured weights
    model = latest(tracked)
    ids = sorted(set(read_tokens(tracked / "data" / "train.bin").tolist()))
    heads = rows[-1]["heads"]
    assert heads["vocabulary"] == len(ids) < 256  # the bytes of the text, not all 256
    g = torch.Generator().manual_seed(0)
    first = torch.tensor(ids)[torch.randint(len(ids), (8, 8), generator=g)]
    want = roles_by_hand(model, torch.cat([first, first], 1))
    for role, table in want.items():
        torch.testing.assert_close(torch.tensor(heads["scores"][role]), table, atol=2e-6, rtol=0)


def test_tracking_changes_no_step(tracked, tmp_path):
    config = tiny_config(tmp_path, TEXT, **SMALL)
    train(config, progress=False)
    plain, with_heads = metrics(tmp_path / "run"), metrics(tracked)
    for key in ("train_loss", "grad_norm", "val_loss"):
        assert [r.get(key) for r in plain] == [r.get(key) for r in with_heads]


def test_a_resume_continues_the_series(tracked, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tracked, run)
    latest_file = run / "checkpoints" / "latest"  # back to step 3, as a run killed during step 4 would be
    latest_file.write_text(json.dumps({**json.loads(latest_file.read_text()), "step": 3, "directory": "step-000003"}))
    with open(run / "metrics.jsonl", "a") as f:  # a line past the checkpoint is cut on resume
        f.write(json.dumps({"step": 7, "train_loss": 9.0, "heads": {"scores": {}}}) + "\n")
    config = TrainConfig.from_dict({**json.loads((run / "config.json").read_text()), "out": str(run)})
    train(config, resume=True, progress=False)
    got, want = metrics(run), metrics(tracked)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in got if "heads" in r] == [3, 6]
    scores = [[torch.tensor(r["heads"]["scores"][role]) for role in sorted(r["heads"]["scores"])]
              for rows in (got, want) for r in rows if "heads" in r]  # fmt: skip
    for a, b in zip(scores[:2], scores[2:], strict=True):
        torch.testing.assert_close(a, b)
    assert not torch.equal(scores[0][-1], scores[1][-1])  # the resumed steps moved the scores


def test_tracking_switched_on_at_a_resume(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    run = tmp_path / "run"
    base = ["--data", str(data), "--preset", "tiny", "--context-length", "16", "--batch-size", "4", "--eval-batches", "2",
            "--threads", "1", "--eval-every", "3", "--warmup", "1", "--out", str(run)]  # fmt: skip
    assert quietly("train", *base, "--max-steps", "3")[0] == 0
    rc, _, err = quietly("train", "--out", str(run), "--resume", "--max-steps", "6", "--track-heads")
    assert rc == 0, err
    assert [r["step"] for r in metrics(run) if "heads" in r] == [6]
    assert json.loads((run / "config.json").read_text())["track_heads"] is True


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(context_length=3), "track_heads needs context_length >= 4"),
        (dict(tensor_parallel=2), "track_heads does not go with tensor_parallel=2"),
        (dict(track_heads="yes"), "track_heads must be a bool"),
    ],
)
def test_config_refusals(tmp_path, values, message):
    with pytest.raises((ValueError, TypeError), match=message):
        tiny_config(tmp_path, TEXT, **{"track_heads": True, **values})


PEEK = '''
from multihead.modules.kinds.mha import MultiHeadAttention
from multihead.modules.registry import register_attention


@register_attention("peek")
class Peek(MultiHeadAttention):
    """MHA that ignores is_causal: every token sees the whole sequence."""

    def forward(self, *args, is_causal=False, **kwargs):
        return super().forward(*args, is_causal=False, **kwargs)
'''


def test_attention_that_sees_later_tokens_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    (tmp_path / "peek_kind.py").write_text(PEEK)
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "text.txt"
    data.write_text(TEXT)
    run = tmp_path / "run"
    argv = ["train", "--import", "peek_kind", "--attention", "peek", "--data", str(data), "--preset", "tiny",
            "--context-length", "16", "--batch-size", "4", "--max-steps", "2", "--threads", "1", "--out", str(run)]  # fmt: skip
    rc, _, err = quietly(*argv, "--track-heads")
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "multihead train: error: --track-heads scores causal head roles" in err and "'peek'" in err
    assert "above the diagonal in blocks.0.attn" in err
    assert not run.exists()
    rc, _, err = quietly(*argv)  # the same run without tracking trains
    assert rc == 0, err


def test_the_check_passes_every_causal_kind_and_draws_nothing():
    from multihead.models.gpt import GPTConfig
    from multihead.train.head_tracking import check_trackable

    state = torch.random.get_rng_state()
    for options in ({}, {"window": 4}, {"sinks": True}):
        check_trackable(GPTConfig.from_preset("tiny", attention="gqa", attention_options={"num_kv_heads": 2, **options}))
    check_trackable(GPTConfig.from_preset("tiny", attention="diff"))
    assert torch.equal(torch.random.get_rng_state(), state)
