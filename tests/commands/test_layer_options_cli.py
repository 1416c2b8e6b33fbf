"""``multihead train --layer-attention-options JSON --positions P``: the run's
checkpoints keep both (resume, generate), ``multihead generate --streaming K,W``
runs past the context, ``multihead compare`` shares both; mistakes are one line."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from support.cli import quietly

from multihead.cli import build_parsers
from multihead.commands.compare import compare_config
from multihead.models.checkpoint import load_checkpoint
from multihead.train import latest_checkpoint, load_training_state
from multihead.train.compare import plan_comparison

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()
TINY = ["--preset", "tiny", "--batch-size", "8", "--eval-batches", "1", "--threads", "1", "--context-length", "32"]
LOCAL_GLOBAL = '[{"window": 8}, {}]'


def write_text(path: Path, lines: int = 300) -> Path:
    rng = random.Random(3)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines)) + "\n")
    return path


def refused(*argv: str) -> str:
    """Exit 2, nothing on stdout, one line on stderr; return it."""
    rc, out, err = quietly(*argv)
    assert rc == 2 and out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("local-global")
    run = folder / "run"
    rc, out, err = quietly("train", "--data", str(write_text(folder / "text.txt")), *TINY, "--max-steps", "2",
                           "--warmup", "1", "--eval-every", "2", "--checkpoint-every", "1", "--out", str(run),
                           "--layer-attention-options", LOCAL_GLOBAL, "--positions", "rope")  # fmt: skip
    assert rc == 0, err
    return run


def test_the_checkpoint_keeps_the_layer_options_and_positions(trained):
    state = load_training_state(latest_checkpoint(trained))
    assert state.config.layer_attention_options == [{"window": 8}, {}] and state.config.positions == "rope"
    model = load_checkpoint(trained)
    assert model.config.layer_attention_options == [{"window": 8}, {}] and model.config.positions == "rope"
    assert [b.attn.sliding_window for b in model.blocks] == [8, None]  # tiny has 2 blocks: local, global
    assert all(b.attn.rope is not None for b in model.blocks) and model.position_embedding is None


def test_resume_keeps_them_and_refuses_other_ones(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    line = refused("train", "--out", str(run), "--resume", "--max-steps", "3", "--layer-attention-options", "[{}]")
    assert "layer_attention_options" in line and "[{}]" in line
    rc, out, err = quietly("train", "--out", str(run), "--resume", "--max-steps", "3")
    assert rc == 0, err
    state = load_training_state(latest_checkpoint(run))
    assert state.step == 3 and state.config.layer_attention_options == [{"window": 8}, {}]
    assert json.loads((run / "config.json").read_text())["positions"] == "rope"


def test_generate_streams_past_the_context_of_the_trained_model(trained):
    n = 3 * 32
    rc, out, err = quietly("generate", "--checkpoint", str(trained), "to be", "--temperature", "0",
                           "--max-new-tokens", str(n), "--streaming", "4,20")  # fmt: skip
    assert rc == 0, err
    assert "streaming: 4 sink tokens + the last 20" in err
    model = load_checkpoint(trained).eval()
    want = model.generate(torch.tensor([list(b"to be")]), n, temperature=0, streaming=(4, 20))
    assert out.rstrip("\n") == bytes(want[0].tolist()).decode("utf-8", errors="replace")
    assert want.shape[1] == 5 + n > 3 * model.config.context_length


@pytest.mark.parametrize(("argv", "match"), [
    (["--streaming", "4,20"], "--streaming 4,20: streaming needs relative positions (rope, alibi or none); "
                              "this model has a learned position table of context_length=128 rows"),
    (["--streaming", "4"], "--streaming 4: expected K,W with K >= 0 sink tokens and W >= 1"),
    (["--streaming", "a,b"], "--streaming a,b: expected K,W"),
    (["--streaming", "1,0"], "--streaming 1,0: expected K,W"),
    (["--streaming", "1,2", "--save-init", "x"], "--save-init only saves the model and generates nothing, so --prompt 'hi', --streaming 1,2 would be ignored"),
])  # fmt: skip
def test_generate_streaming_mistakes_are_one_line(argv, match):
    assert match in refused("generate", "--preset", "tiny", "hi", *argv)


def test_streaming_beyond_the_models_context_is_one_line(trained):
    line = refused("generate", "--checkpoint", str(trained), "hi", "--streaming", "4,29")
    assert "sink_tokens + window = 4 + 29 = 33 positions, more than the model's context_length=32" in line


@pytest.mark.parametrize(("value", "match"), [
    ('[{"window": 8}', """'[{"window": 8}' is not JSON (Expecting ',' delimiter"""),
    ('{"window": 8}', "expected a JSON list of dicts of option name -> value"),
    ("[]", "expected a JSON list of dicts"),
    ("[1, 2]", "expected a JSON list of dicts"),
    ('[{"windo": 8}, {}]', "block 0 (layer_attention_options[0] = {'windo': 8}): attention kind 'mha' has no option "
                           "'windo' (did you mean 'window'?)"),
    ('[{"window": 0}, {}]', "block 0 (layer_attention_options[0] = {'window': 0}): window must be an int >= 1"),
    ("[{}, {}, {}]", "layer_attention_options holds 3 dicts; give 1 .. num_layers=2"),
])  # fmt: skip
def test_train_layer_option_mistakes_are_one_line_and_write_nothing(tmp_path, value, match):
    out = tmp_path / "run"
    line = refused("train", "--data", str(write_text(tmp_path / "t.txt", 50)), *TINY, "--out", str(out),
                   "--layer-attention-options", value)  # fmt: skip
    assert line.startswith("multihead train: error: ") and match in line
    assert not out.exists()


def test_train_positions_mistake_is_one_line(tmp_path):
    line = refused("train", *TINY, "--out", str(tmp_path / "r"), "--positions", "absolute")
    assert "positions must be one of ['learned', 'rope', 'alibi', 'none'], got positions='absolute'" in line


def test_compare_shares_the_layer_options_and_positions():
    args = build_parsers()[0].parse_args(["compare", "--quick", "--attention", "mha,gqa", "--positions", "alibi",
                                          "--layer-attention-options", '[{"window": 4}]'])  # fmt: skip
    base, model, plans = plan_comparison(compare_config(args))
    assert base.positions == "alibi" and base.layer_attention_options == [{"window": 4}]
    assert model.positions == "alibi" and model.layer_attention_options == [{"window": 4}]
    # no position table: the MHA model is context_length x width parameters smaller than GPT-2's layout
    learned = plan_comparison(compare_config(build_parsers()[0].parse_args(["compare", "--quick", "--attention", "mha"])))
    assert learned[2][0].parameters - plans[0].parameters == 32 * 64
