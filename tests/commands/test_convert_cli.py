"""``multihead convert --to gqa``: a checkpoint or a training run converted, saved and reported."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from support.cli import quietly
from support.training import latest, run_val_loss

from multihead.commands.convert import CALIBRATION_BATCH_SIZE, CALIBRATION_SEED, DEFAULT_CALIBRATION_BATCHES
from multihead.commands.recovery_option import RECOVER_LR
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.convert_heads import to_gqa
from multihead.tools.recovery import recover
from multihead.train.batches import Batches, read_tokens

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()
TINY = ["--preset", "tiny", "--context-length", "32", "--batch-size", "4", "--eval-batches", "2", "--warmup", "1",
        "--threads", "1", "--max-steps", "2", "--eval-every", "2", "--checkpoint-every", "2"]  # fmt: skip


def write_text(path: Path, lines: int = 300, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines)) + "\n")
    return path


def train(folder: Path, *extra: str) -> Path:
    run = folder / "run"
    rc, _, err = quietly("train", "--data", str(write_text(folder / "text.txt")), *TINY, *extra, "--out", str(run))
    assert rc == 0, err
    return run


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    return train(tmp_path_factory.mktemp("bpe"), "--tokenizer", "bpe", "--vocab-size", "300")


def kv_bytes(model: GPT) -> int:
    """2 (keys and values) x G heads x D x 4 bytes (float32) per layer."""
    c = model.config
    return c.num_layers * 2 * model.blocks[0].attn.num_kv_heads * (c.embed_dim // c.num_heads) * 4


def assert_same_weights(got: GPT, want: GPT) -> None:
    # the same conversion, run once in the command and once here: compared with tolerances
    # (the aligned fit's eigen-solvers may round differently across thread counts)
    assert got.config == want.config
    w, g = want.state_dict(), got.state_dict()
    assert w.keys() == g.keys()
    for name in w:
        torch.testing.assert_close(g[name], w[name], msg=name)


def test_mean_on_a_byte_run_reports_and_saves(byte_run, tmp_path):
    out = tmp_path / "gqa"
    rc, stdout, err = quietly(
        "convert", "--to", "gqa", "--num-kv-heads", "2", "--checkpoint", str(byte_run), "--out", str(out)
    )
    assert rc == 0, err
    original = latest(byte_run)
    want = to_gqa(original, 2).eval()
    got = load_checkpoint(out).eval()
    assert_same_weights(got, want)
    report = json.loads((out / "report.json").read_text())
    assert report["attention"] == ["mha", "gqa"] and report["num_kv_heads"] == [4, 2] and report["method"] == "mean"
    assert report["parameters"] == [original.num_parameters(), want.num_parameters()]
    assert report["parameters"][1] < report["parameters"][0]
    assert report["kv_cache_bytes_per_token"] == [kv_bytes(original), kv_bytes(want)]
    assert report["kv_cache_bytes_per_token"][1] * 2 == report["kv_cache_bytes_per_token"][0]
    before, after = report["val_loss"]
    assert before == pytest.approx(run_val_loss(original, byte_run), rel=1e-5)
    assert after == pytest.approx(run_val_loss(want, byte_run), rel=1e-5)
    assert report["kv_cache_dtype"] == "float32"
    kv_row = next(line for line in stdout.splitlines() if "KV cache (bytes/token, float32)" in line)
    assert kv_row.split()[-2:] == [str(kv_bytes(original)), str(kv_bytes(want))]
    assert "val loss" in stdout and f"{after:.4f}" in stdout
    assert not (out / "tokenizer.json").exists()  # bytes: generate needs no tokenizer
    rc, text, err = quietly("generate", "--checkpoint", str(out), "To be", "--max-new-tokens", "3", "--seed", "0")
    assert rc == 0 and text.startswith("To be"), err


def test_aligned_calibrates_on_the_run_training_tokens(byte_run, tmp_path):
    out = tmp_path / "mqa"
    rc, _, err = quietly("convert", "--to", "gqa", "--num-kv-heads", "1", "--method", "aligned",
                         "--calibration-batches", "2", "--checkpoint", str(byte_run), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    original = latest(byte_run)
    batches = Batches(read_tokens(byte_run / "data" / "train.bin"), batch_size=CALIBRATION_BATCH_SIZE,
                      context_length=original.config.context_length, seed=CALIBRATION_SEED)  # fmt: skip
    want = to_gqa(original, 1, method="aligned", calibration=[batches.get(i)[0] for i in range(2)])
    assert_same_weights(load_checkpoint(out), want)
    report = json.loads((out / "report.json").read_text())
    assert report["attention"] == ["mha", "mqa"] and report["calibration_batches"] == 2
    assert report["val_loss"][1] == pytest.approx(run_val_loss(want.eval(), byte_run), rel=1e-5)


def test_recovery_distils_towards_the_original(byte_run, tmp_path):
    out = tmp_path / "recovered"
    rc, stdout, err = quietly("convert", "--to", "gqa", "--num-kv-heads", "1", "--recover-steps", "3",
                              "--calibration-batches", "2", "--checkpoint", str(byte_run), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    original = latest(byte_run)
    batches = Batches(read_tokens(byte_run / "data" / "train.bin"), batch_size=CALIBRATION_BATCH_SIZE,
                      context_length=original.config.context_length, seed=CALIBRATION_SEED)  # fmt: skip
    xs = [batches.get(i)[0] for i in range(2)]
    converted = to_gqa(original, 1).eval()
    before = run_val_loss(converted, byte_run)
    losses = recover(converted, original, xs, lambda m, x: m(x[:, :-1]), steps=3, lr=RECOVER_LR["gpt"],
                     objective="kl", progress=False)  # fmt: skip
    got = load_checkpoint(out).eval()
    assert_same_weights(got, converted.eval())
    report = json.loads((out / "report.json").read_text())
    assert report["recovery"]["steps"] == 3 and report["recovery"]["objective"] == "kl"
    assert report["recovery"]["loss"] == pytest.approx([losses[0], losses[-1]], rel=1e-4)
    assert report["recovery"]["before"] == pytest.approx(before, rel=1e-5)
    assert report["val_loss"][1] == pytest.approx(run_val_loss(got, byte_run), rel=1e-5)
    assert "recovery: 3 steps of kl distillation" in stdout


def test_bpe_run_brings_its_tokenizer_for_generate(bpe_run, tmp_path):
    out = tmp_path / "gqa"
    rc, stdout, err = quietly(
        "convert", "--to", "gqa", "--num-kv-heads", "2", "--checkpoint", str(bpe_run), "--out", str(out)
    )
    assert rc == 0, err
    assert (out / "tokenizer.json").read_bytes() == (bpe_run / "tokenizer" / "tokenizer.json").read_bytes()
    assert f"try: multihead generate --checkpoint {out} " in stdout and "--tokenizer" not in stdout
    # the folder alone brings its tokenizer.json (run_dir); the same file given by hand gives the same text
    rc, text, err = quietly("generate", "--checkpoint", str(out), "to be", "--max-new-tokens", "3", "--seed", "0")
    assert rc == 0 and text.startswith("to be") and f"checkpoint {out}, bpe tokenizer" in err, err
    by_hand = quietly("generate", "--checkpoint", str(out), "--tokenizer", str(out / "tokenizer.json"),
                      "to be", "--max-new-tokens", "3", "--seed", "0")  # fmt: skip
    assert by_hand[:2] == (0, text), by_hand[2]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A byte-level checkpoint that is not a training run."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("plain") / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32)), path)
    return path


def test_aligned_plain_checkpoint_with_calibration_text(plain, tmp_path):
    text = write_text(tmp_path / "calib.txt", seed=3)
    out = tmp_path / "gqa"
    rc, stdout, err = quietly("convert", "--to", "gqa", "--num-kv-heads", "2", "--method", "aligned", "--checkpoint",
                              str(plain), "--calibration-data", str(text), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["val_loss"] is None and "val loss" not in stdout
    from multihead.train.corpus import load_corpus

    tokens = torch.tensor(list(load_corpus(str(text)).train.encode("utf-8")))
    batches = Batches(tokens.numpy(), batch_size=CALIBRATION_BATCH_SIZE, context_length=32, seed=CALIBRATION_SEED)
    assert_same_weights(load_checkpoint(out), to_gqa(load_checkpoint(plain), 2, method="aligned",
                        calibration=[batches.get(i)[0] for i in range(DEFAULT_CALIBRATION_BATCHES)]))  # fmt: skip
    assert report["calibration_batches"] == DEFAULT_CALIBRATION_BATCHES


def refused(*argv: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr; return that line."""
    rc, out, err = quietly("convert", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("multihead convert: error: "), err
    return err.strip()


def test_mistakes_are_one_line_and_write_nothing(plain, tmp_path):
    out = tmp_path / "out"
    base = ["--to", "gqa", "--checkpoint", str(plain), "--out", str(out)]
    assert "--num-kv-heads 3 does not divide the model's 4 heads" in refused(*base, "--num-kv-heads", "3")
    assert "--num-kv-heads 5 out of range" in refused(*base, "--num-kv-heads", "5")
    assert "--num-kv-heads 0 out of range" in refused(*base, "--num-kv-heads", "0")
    assert "--method median: unknown method" in refused(*base, "--num-kv-heads", "2", "--method", "median")
    assert "--to moh: unknown target" in refused(*base[2:], "--to", "moh", "--num-kv-heads", "2")
    assert "only go with --method aligned" in refused(*base, "--num-kv-heads", "2", "--calibration-data", "shakespeare")
    assert "--recover-steps -1: give a number of steps >= 0" in refused(*base, "--num-kv-heads", "2",
                                                                        "--recover-steps", "-1")  # fmt: skip
    assert "needs calibration text" in refused(*base, "--num-kv-heads", "2", "--method", "aligned")
    assert "--calibration-batches 0" in refused(*base, "--num-kv-heads", "2", "--method", "aligned",
                                               "--calibration-data", "x.txt", "--calibration-batches", "0")  # fmt: skip
    assert "--heldout-lines 10: give a number >= 11" in refused("--to", "mqa", "--model", "minilm-l6", "--heldout-lines", "10",
                                                                "--out", str(out))  # fmt: skip
    file = tmp_path / "file"
    file.write_text("")
    line = refused("--to", "gqa", "--num-kv-heads", "2", "--checkpoint", str(plain), "--out", str(file / "x"))
    assert f"--out {file / 'x'}" in line
    assert not out.exists()


def test_refuses_rope_for_aligned_and_models_without_heads(tmp_path):
    rope = tmp_path / "rope"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32, attention_options={"rope": True})), rope)
    text = write_text(tmp_path / "t.txt")
    line = refused("--to", "gqa", "--num-kv-heads", "2", "--method", "aligned", "--checkpoint", str(rope),
                   "--calibration-data", str(text), "--out", str(tmp_path / "o"))  # fmt: skip
    assert "rope=True" in line and "--method mean" in line
    other = tmp_path / "talking"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32, attention="talking_heads")), other)
    line = refused("--to", "gqa", "--num-kv-heads", "2", "--checkpoint", str(other), "--out", str(tmp_path / "o"))
    assert "'talking_heads'" in line
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    line = refused("--to", "gqa", "--num-kv-heads", "2", "--checkpoint", str(bert), "--out", str(tmp_path / "o"))
    assert str(bert) in line
    assert not (tmp_path / "o").exists()
