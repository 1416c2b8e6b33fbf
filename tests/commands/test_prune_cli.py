"""``multihead prune --checkpoint``: a training run pruned, saved and reported; mistakes refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support.cli import quietly
from support.training import latest, run_val_loss

from multihead.commands.convert import CALIBRATION_BATCH_SIZE, CALIBRATION_SEED
from multihead.commands.recovery_option import RECOVER_LR
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.distill import distillation
from multihead.tools.fidelity import keep_heads
from multihead.tools.gate_importance import GateTraining, gate_sweep
from multihead.tools.importance import head_importance
from multihead.tools.objectives import GATE_LR
from multihead.tools.prune import prune_heads
from multihead.tools.recovery import recover
from multihead.train.batches import Batches, read_tokens

TINY = ["--preset", "tiny", "--context-length", "32", "--batch-size", "4", "--eval-batches", "2", "--warmup", "1",
        "--threads", "1", "--max-steps", "2", "--eval-every", "2", "--checkpoint-every", "2"]  # fmt: skip
TEXT = "to be or not to be that is the question whether tis nobler in the mind to suffer\n" * 200


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bytes")
    (folder / "text.txt").write_text(TEXT)
    rc, _, err = quietly("train", "--data", str(folder / "text.txt"), *TINY, "--out", str(folder / "run"))
    assert rc == 0, err
    return folder / "run"


def refused(*argv: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr; return that line."""
    rc, out, err = quietly("prune", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("multihead prune: error: "), err
    return err.strip()


def lm_loss(model, x):  # written out here: next-token cross-entropy of windows [B, T]
    return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())


def test_ablation_on_a_byte_run_saves_the_pruned_model(byte_run, tmp_path):
    out = tmp_path / "pruned"
    rc, stdout, err = quietly("prune", "--checkpoint", str(byte_run), "--method", "ablation", "--keep", "0.5",
                              "--calibration-lines", "32", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    original = latest(byte_run)
    batches = Batches(read_tokens(byte_run / "data" / "train.bin"), batch_size=CALIBRATION_BATCH_SIZE,
                      context_length=original.config.context_length, seed=CALIBRATION_SEED)  # fmt: skip
    xs = [batches.get(i)[0] for i in range(32 // CALIBRATION_BATCH_SIZE)]
    scores = head_importance(original, xs, lm_loss, method="ablation", normalize=None)
    L, H = scores.shape
    table = keep_heads(scores, round(0.5 * L * H))
    want = prune_heads(latest(byte_run), table).eval()
    got = load_checkpoint(out).eval()
    assert got.config == want.config
    w, g = want.state_dict(), got.state_dict()
    assert w.keys() == g.keys()
    for name in w:  # the same pruning of the same weights: a copy, bitwise
        assert torch.equal(g[name], w[name]), name
    report = json.loads((out / "report.json").read_text())
    assert report["heads"] == [L * H, L * H // 2]
    assert report["layer_heads"] == [H - len(table.get(i, [])) for i in range(L)] == got.config.layer_heads
    assert min(report["layer_heads"]) >= 1
    # each removed head takes D rows of q, k, v (weight and bias) and D input columns of out_proj
    C, D = original.config.embed_dim, original.config.embed_dim // H
    removed = sum(len(v) for v in report["removed"].values())
    assert report["parameters"] == [original.num_parameters(), original.num_parameters() - removed * D * (4 * C + 3)]
    assert report["parameters"][1] == sum(p.numel() for p in got.parameters())
    before, after = report["val_loss"]
    assert before == pytest.approx(run_val_loss(original, byte_run), rel=1e-5)
    assert after == pytest.approx(run_val_loss(got, byte_run), rel=1e-5)
    speed = report["speedup"]
    assert 0 < speed["min"] <= speed["median"] <= speed["max"] and speed["rounds"] == 7 and len(report["seconds"]) == 2
    assert speed["below_noise"] == (speed["min"] <= 1.0 <= speed["max"])
    assert "speed-up" in stdout and f"{after:.4f}" in stdout


def test_gates_score_the_kl_to_the_unpruned_model(byte_run, tmp_path):
    out = tmp_path / "gates"
    rc, stdout, err = quietly("prune", "--checkpoint", str(byte_run), "--method", "gates", "--keep", "0.5",
                              "--calibration-lines", "16", "--gate-penalties", "0.5,2", "--gate-steps", "3",
                              "--out", str(out))  # fmt: skip
    assert rc == 0, err
    original = latest(byte_run)
    batches = Batches(read_tokens(byte_run / "data" / "train.bin"), batch_size=CALIBRATION_BATCH_SIZE,
                      context_length=original.config.context_length, seed=CALIBRATION_SEED)  # fmt: skip
    xs = [batches.get(0)[0]]
    pairs, kl = distillation(original, xs, lambda m, x: m(x[:, :-1]), objective="kl")
    training = GateTraining(penalties=(0.5, 2.0), steps=3, lr=GATE_LR)
    scores = gate_sweep(original, pairs, kl, training).scores
    L, H = scores.shape
    want = prune_heads(latest(byte_run), keep_heads(scores, round(0.5 * L * H)))
    got = load_checkpoint(out)
    assert got.config == want.config
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "gates"
    assert report["gates"] == {"penalties": [0.5, 2.0], "steps": 3, "lr": GATE_LR}
    assert "gates trained at penalties [0.5, 2.0], 3 steps each" in stdout


def test_recovery_after_pruning(byte_run, tmp_path):
    out = tmp_path / "recovered"
    rc, stdout, err = quietly("prune", "--checkpoint", str(byte_run), "--method", "ablation", "--keep", "0.5",
                              "--calibration-lines", "16", "--recover-steps", "2", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    original = latest(byte_run)
    batches = Batches(read_tokens(byte_run / "data" / "train.bin"), batch_size=CALIBRATION_BATCH_SIZE,
                      context_length=original.config.context_length, seed=CALIBRATION_SEED)  # fmt: skip
    xs = [batches.get(0)[0]]
    scores = head_importance(original, xs, lm_loss, method="ablation", normalize=None)
    L, H = scores.shape
    pruned = prune_heads(latest(byte_run), keep_heads(scores, round(0.5 * L * H))).eval()
    before = run_val_loss(pruned, byte_run)
    recover(pruned, original, xs, lambda m, x: m(x[:, :-1]), steps=2, lr=RECOVER_LR["gpt"], progress=False)
    got = load_checkpoint(out).eval()
    for name, value in pruned.state_dict().items():  # the same steps in the command and here
        torch.testing.assert_close(got.state_dict()[name], value, msg=name)
    report = json.loads((out / "report.json").read_text())
    assert report["recovery"]["before"] == pytest.approx(before, rel=1e-5)
    assert report["val_loss"][1] == pytest.approx(run_val_loss(got, byte_run), rel=1e-5)
    assert "recovery: 2 steps of kl distillation" in stdout


def test_gradient_keep_one_leaves_every_head(byte_run, tmp_path):
    out = tmp_path / "all"
    rc, _, err = quietly("prune", "--checkpoint", str(byte_run), "--method", "gradient", "--keep", "1",
                         "--calibration-lines", "16", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["parameters"][0] == report["parameters"][1]
    assert all(v == [] for v in report["removed"].values())
    before, after = report["val_loss"]
    assert after == pytest.approx(before, rel=1e-6)


def test_tiny_keep_leaves_one_head_per_layer(tmp_path):
    torch.manual_seed(0)
    plain = tmp_path / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32)), plain)
    out = tmp_path / "one"
    rc, _, err = quietly("prune", "--checkpoint", str(plain), "--method", "gradient", "--keep", "0.01",
                         "--calibration-lines", "16", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["layer_heads"] == [1] * len(report["layer_heads"]) and report["val_loss"] is None
    assert load_checkpoint(out).config.layer_heads == report["layer_heads"]


def test_a_pruned_model_prunes_again(tmp_path):
    torch.manual_seed(0)
    plain = tmp_path / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32, num_layers=2)), plain)
    once, twice = tmp_path / "once", tmp_path / "twice"
    for source, out, keep in ((plain, once, "0.75"), (once, twice, "0.5")):
        rc, _, err = quietly("prune", "--checkpoint", str(source), "--method", "gradient", "--keep", keep,
                             "--calibration-lines", "16", "--out", str(out))  # fmt: skip
        assert rc == 0, err
    first = json.loads((once / "report.json").read_text())
    second = json.loads((twice / "report.json").read_text())
    assert first["heads"] == [8, 6] and second["heads"] == [6, 3]  # of the heads the model has
    for layer, left in enumerate(second["layer_heads"]):
        assert left == first["layer_heads"][layer] - len(second["removed"][str(layer)]) >= 1
    assert load_checkpoint(twice).config.layer_heads == second["layer_heads"]


def test_mistakes_are_one_line_and_write_nothing(tmp_path):
    plain = tmp_path / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32)), plain)
    out = tmp_path / "out"
    base = ["--checkpoint", str(plain), "--out", str(out)]
    assert "--keep 0.0" in refused(*base, "--method", "gradient", "--keep", "0")
    assert "--keep 1.5" in refused(*base, "--method", "gradient", "--keep", "1.5")
    assert "--method taylor: unknown method" in refused(*base, "--method", "taylor", "--keep", "0.5")
    assert "exactly one of --model, --checkpoint and --hf" in refused(*base, "--model", "minilm-l6", "--method",
                                                                "gradient", "--keep", "0.5")  # fmt: skip
    assert "are for --method gates, not --method gradient" in refused(*base, "--method", "gradient", "--keep", "0.5",
                                                                      "--gate-steps", "3")  # fmt: skip
    assert "steps must be an int >= 1, got steps=0" in refused(*base, "--method", "gates", "--keep", "0.5",
                                                               "--gate-steps", "0")  # fmt: skip
    assert "every penalty must be a finite float >= 0" in refused(*base, "--method", "gates", "--keep", "0.5",
                                                                  "--gate-penalties", "0.1,-1")  # fmt: skip
    rc, _, err = quietly("prune", *base, "--method", "gates", "--keep", "0.5", "--gate-penalties", "a")
    assert rc == 2 and err.splitlines()[-1].endswith("give comma-separated numbers such as 0.1,0.3, got 'a'; see 'multihead prune --help'"), err
    moh = tmp_path / "moh"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32, attention="moh")), moh)
    assert "'moh'" in refused("--checkpoint", str(moh), "--out", str(out), "--method", "gradient", "--keep", "0.5")
    file = tmp_path / "file"
    file.write_text("")
    assert f"--out {file / 'x'}" in refused("--checkpoint", str(plain), "--out", str(file / "x"), "--method",
                                            "gradient", "--keep", "0.5")  # fmt: skip
    assert not out.exists()
