"""``multihead train --sample-every N``: a greedy sample every N steps, and the
run's numbers are those of a run without samples."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch
from support.cli import quietly

from multihead.models.checkpoint import load_checkpoint
from multihead.train.batches import read_tokens
from multihead.train.sampling import PROMPT_TOKENS, SAMPLE_TOKENS
from multihead.train.tokenizer import load_tokenizer_dir

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()
TINY = ["--preset", "tiny", "--batch-size", "8", "--eval-batches", "2", "--threads", "1", "--context-length", "16",
        "--max-steps", "4", "--eval-every", "2", "--log-every", "1", "--checkpoint-every", "4"]  # fmt: skip


def greedy(model, ids: list[int], new: int) -> list[int]:
    """Argmax decoding without a cache, the window cropped to the context length."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(new):
            window = torch.tensor([out[-model.config.context_length :]])
            out.append(int(model(window)[0, -1].argmax()))
    return out[len(ids) :]


def test_samples_are_greedy_continuations_of_the_validation_text_and_change_nothing(tmp_path):
    rng = random.Random(3)
    data = tmp_path / "text.txt"
    data.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(400)) + "\n")
    rc, out, err = quietly("train", "--data", str(data), *TINY, "--sample-every", "2", "--out", str(tmp_path / "s"))
    assert rc == 0, err
    lines = [line for line in err.splitlines() if line.startswith("sample at step")]
    assert [re.match(r"sample at step (\d+): ", line)[1] for line in lines] == ["2", "4"]

    run = tmp_path / "s"
    tokenizer = load_tokenizer_dir(run / "tokenizer")
    prompt = [int(t) for t in read_tokens(run / "data" / "val.bin")[:PROMPT_TOKENS]]
    model = load_checkpoint(run / "checkpoints" / "step-000004").eval()
    want = f"sample at step 4: {tokenizer.decode(prompt)!r} -> {tokenizer.decode(greedy(model, prompt, SAMPLE_TOKENS))!r}"
    assert lines[-1] == want

    rc, _, err = quietly("train", "--data", str(data), *TINY, "--out", str(tmp_path / "plain"))
    assert rc == 0, err
    got, plain = ([json.loads(line) for line in Path(r, "metrics.jsonl").read_text().splitlines()]
                  for r in (run, tmp_path / "plain"))  # fmt: skip
    for key in ("train_loss", "grad_norm"):
        torch.testing.assert_close(torch.tensor([m[key] for m in got]), torch.tensor([m[key] for m in plain]))
