"""``multihead train --init-from DIR``: fine-tuning a Hugging Face GPT-2 folder
starts from its weights, with its tokenizer and context length; what cannot
go with it is refused before anything is written; a resume needs the folder
no more."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from support.cli import quietly
from tokenizers import Tokenizer

from multihead.train.batches import read_tokens, val_batches
from multihead.train.loop import VAL_SEED
from multihead.train.tokenizer import BPETokenizer, load_tokenizer_dir

transformers = pytest.importorskip("transformers")

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()
N_POSITIONS = 32
RUN = ["--batch-size", "8", "--eval-batches", "2", "--threads", "1"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(text file, GPT-2 folder, the HF model): a 2-layer GPT-2 whose 300-token
    BPE tokenizer is learned from the text; its token embedding is scaled up so
    its loss is far from a fresh model's ln 300."""
    base = tmp_path_factory.mktemp("gpt2")
    rng = random.Random(5)
    text = base / "text.txt"
    text.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(400)) + "\n")
    tokenizer = BPETokenizer.train(text.read_text(), 300)
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=300, n_positions=N_POSITIONS, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        hf.transformer.wte.weight.mul_(20.0)
    folder = base / "gpt2"
    hf.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(tokenizer.to_str())
    return text, folder, hf


def hf_val_loss(hf, run) -> float:
    """transformers' own loss on the run's fixed validation batches."""
    config = json.loads((run / "config.json").read_text())
    sets = val_batches(read_tokens(run / "data" / "val.bin"), batch_size=config["batch_size"],
                       context_length=config["context_length"], num_batches=config["eval_batches"], seed=VAL_SEED)  # fmt: skip
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten(), reduction="sum")
                  for x, y in sets]  # fmt: skip
    return float(sum(losses)) / sum(y.numel() for _, y in sets)


def test_a_run_starts_from_the_folder_with_its_tokenizer_and_context_and_resumes_without_it(folder, tmp_path):
    text, source, hf = folder
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(source, gpt2)
    run = tmp_path / "run"
    # a learning rate of 1e-9: the one step leaves the weights as they were, to float32 precision
    steps = ["--max-steps", "1", "--lr", "1e-9", "--min-lr", "0", "--eval-every", "1"]
    rc, out, err = quietly("train", "--data", str(text), "--init-from", str(gpt2), *RUN, *steps, "--out", str(run))
    assert rc == 0, err
    config = json.loads((run / "config.json").read_text())
    assert config["context_length"] == N_POSITIONS and config["preset"] is None and config["tokenizer"] == "bpe"
    assert config["init_from"] == str(gpt2)
    sample = "whether tis nobler in the mind to suffer"
    folder_ids = Tokenizer.from_file(str(gpt2 / "tokenizer.json")).encode(sample).ids
    assert load_tokenizer_dir(run / "tokenizer").encode(sample) == folder_ids

    val = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["val_loss"]
    want = hf_val_loss(hf, run)
    assert abs(want - math.log(300)) > 1.0  # a fresh model would not pass
    assert val == pytest.approx(want, rel=1e-4)

    shutil.rmtree(gpt2)  # the checkpoint holds the model, the run its tokenizer
    rc, out, err = quietly("train", "--out", str(run), "--resume", "--max-steps", "2", "--lr", "1e-9")
    assert rc == 0, err
    assert "(step 2)" in out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--preset", "tiny"], "init_from takes the model and its tokenizer from {gpt2}; {{'preset': 'tiny'}} cannot go"),
        (["--attention", "gqa"], "attention must be 'mha', got attention='gqa'; a Hugging Face GPT-2 folder holds "
                                 "one key and one value head per query head"),
        (["--tokenizer", "bytes"], "init_from uses the folder's BPE tokenizer; tokenizer='bytes' cannot go with it"),
        (["--context-length", "64"], "context_length=64 is longer than the init_from model allows (n_positions=32"),
    ],
)
def test_what_cannot_go_with_init_from_is_refused_before_anything_is_written(folder, tmp_path, flags, message):
    text, gpt2, _ = folder
    rc, out, err = quietly("train", "--data", str(text), "--init-from", str(gpt2), *flags, "--out", str(tmp_path / "r"))
    assert rc == 2 and out == "" and len(err.splitlines()) == 1, err
    assert message.format(gpt2=gpt2) in err
    assert not (tmp_path / "r").exists()


def test_a_folder_without_weights_is_refused_naming_the_file(folder, tmp_path):
    text, source, _ = folder
    gpt2 = tmp_path / "gpt2"
    shutil.copytree(source, gpt2)
    (gpt2 / "model.safetensors").unlink()
    rc, out, err = quietly("train", "--data", str(text), "--init-from", str(gpt2), "--out", str(tmp_path / "r"))
    assert rc == 2 and f"init_from {gpt2}: no model.safetensors in it" in err, err
    assert not (tmp_path / "r").exists()
