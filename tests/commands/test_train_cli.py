"""``multihead train`` (flags -> TrainConfig, mistakes, a tiny real run) and
``multihead generate --checkpoint RUN_DIR``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from support.cli import quietly

from multihead.cli import build_parsers
from multihead.commands.train import FLAGS, OTHER_FIELDS, config_values, is_rank_zero, parse_attention_options
from multihead.models.checkpoint import load_checkpoint
from multihead.train.config import TrainConfig
from multihead.train.tokenizer import load_tokenizer_dir

WORDS = "to be or not that is the question whether tis nobler in mind suffer slings and arrows".split()


def write_text(path: Path, lines: int = 400, seed: int = 0) -> Path:
    """A small English-looking UTF-8 text (about 50 bytes a line)."""
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(lines)) + "\n")
    return path


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def parse(*argv: str) -> dict:
    return config_values(build_parsers()[0].parse_args(["train", *argv]))




def refused(capsys, *argv: str, command: str = "train") -> str:
    """Exit 2, nothing on stdout, exactly one line on stderr; return that line."""
    rc, out, err = quietly(*argv)
    assert rc == 2 and out == "" and "Traceback" not in err, err
    assert len(err.splitlines()) == 1 and err.startswith(f"multihead {command}: error: "), err
    return err.strip()


# -- flags -> TrainConfig ---------------------------------------------------------------------------


def test_every_trainconfig_field_has_its_flag():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert {f.field for f in FLAGS} | set(OTHER_FIELDS) == fields
    assert len({f.name for f in FLAGS}) == len(FLAGS)


def test_no_flag_leaves_trainconfig_defaults():
    assert parse() == {}
    assert TrainConfig(**parse()) == TrainConfig()


def test_flags_set_the_fields_of_the_same_name():
    argv = [
        "--data", "notes.txt", "--tokenizer", "bpe", "--vocab-size", "300", "--preset", "tiny",
        "--attention", "gqa", "--attention-option", "num_kv_heads=2", "--context-length", "64",
        "--batch-size", "12", "--grad-accum", "3", "--max-steps", "40", "--lr", "3e-3", "--min-lr", "1e-5",
        "--warmup", "4", "--weight-decay", "0.05", "--grad-clip", "0.5", "--beta1", "0.8", "--beta2", "0.99",
        "--dropout", "0.1", "--mlp-dim", "200", "--eval-every", "10", "--eval-batches", "2", "--log-every", "5",
        "--checkpoint-every", "20", "--seed", "7", "--dtype", "bfloat16", "--out", "runs/x", "--threads", "1",
        "--device", "cpu", "--shard", "--sample-every", "10", "--tensor-parallel", "2",
        "--layer-attention-options", '[{"window": 16}, {}]', "--positions", "rope", "--no-track-heads",
    ]  # fmt: skip
    want = TrainConfig(
        data="notes.txt", tokenizer="bpe", vocab_size=300, preset="tiny", attention="gqa",
        attention_options={"num_kv_heads": 2}, context_length=64, batch_size=12, grad_accum=3, max_steps=40,
        lr=3e-3, min_lr=1e-5, warmup=4, weight_decay=0.05, grad_clip=0.5, beta1=0.8, beta2=0.99, dropout=0.1,
        mlp_dim=200, eval_every=10, eval_batches=2, log_every=5, checkpoint_every=20, seed=7, dtype="bfloat16", out="runs/x",
        threads=1, device="cpu", shard=True, sample_every=10, tensor_parallel=2,
        layer_attention_options=[{"window": 16}, {}], positions="rope", track_heads=False,
    )  # fmt: skip
    values = parse(*argv)
    # every field was given but init_from, which takes the model from a folder instead
    assert set(values) == {f.name for f in dataclasses.fields(TrainConfig)} - {"init_from"}
    assert TrainConfig(**values) == want
    assert parse("--init-from", "gpt2-folder") == {"init_from": "gpt2-folder"}


def test_a_bool_field_is_a_flag_pair():
    assert parse("--shard") == {"shard": True}
    assert parse("--no-shard") == {"shard": False}  # a resumed sharded run can switch it off
    assert "shard" not in parse("--lr", "0.01")  # neither: TrainConfig's default (or the saved config's)


def test_help_shows_trainconfig_defaults():
    parser = build_parsers()[1]["train"]
    helps = {action.dest: action.help for action in parser._actions}
    defaults = TrainConfig.__dataclass_fields__
    for flag in FLAGS:
        default = defaults[flag.field].default
        assert (f"(default {default})" if default is not None else "(default ") in helps[flag.field], flag.name
    text = parser.format_help()
    assert "examples:" in text and "multihead generate --checkpoint" in text


def test_help_examples_parse_into_configs(monkeypatch):
    """Every ``multihead train`` example of the help builds a TrainConfig (running them is the tiny run below)."""
    monkeypatch.chdir(Path(__file__).parent)  # no runs/ folder here
    text = build_parsers()[1]["train"].format_help()
    examples = [shlex.split(line) for line in text.split("examples:")[1].splitlines() if line.strip()]
    train = [argv[2:] for argv in examples if argv[:2] == ["multihead", "train"]]
    assert len(train) >= 4 and any("--resume" in argv for argv in train)
    assert any(argv[:2] == ["torchrun", "--nproc-per-node"] and "multihead" in argv for argv in examples)
    for argv in train:
        values = parse(*argv)
        if "--import" in argv:  # the kind comes from the user's module: only the flags are checked here
            assert build_parsers()[0].parse_args(["train", *argv]).imports == ["mykinds"], argv
            continue
        assert TrainConfig(**values).out == values.get("out", TrainConfig().out), argv


@pytest.mark.parametrize(
    "items,want",
    [
        (["num_kv_heads=2"], {"num_kv_heads": 2}),
        (
            ["scale=0.5", "flag=true", "off=false", "none=null"],
            {"scale": 0.5, "flag": True, "off": False, "none": None},
        ),
        (["mode=fast", 'quoted="16"', "empty="], {"mode": "fast", "quoted": "16", "empty": ""}),
        (["sizes=[1, 2]", "expr=a=b"], {"sizes": [1, 2], "expr": "a=b"}),
        ([" window =16"], {"window": 16}),
    ],
)
def test_attention_options_are_json_or_strings(items, want):
    assert parse_attention_options(items) == want
    assert parse(*[a for item in items for a in ("--attention-option", item)])["attention_options"] == want


@pytest.mark.parametrize(
    "items,message",
    [
        (["window"], "--attention-option 'window': expected K=V"),
        (["=3"], "--attention-option '=3': expected K=V"),
        (["two words=1"], "the option name 'two words' is not a valid name"),
        (["window=1", "window=2"], "--attention-option window is given twice (window=1 and 'window=2')"),
    ],
)
def test_bad_attention_options(items, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_attention_options(items)


def test_rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert is_rank_zero()
    monkeypatch.setenv("RANK", "0")
    assert is_rank_zero()
    monkeypatch.setenv("RANK", "1")
    assert not is_rank_zero()
    monkeypatch.setenv("RANK", "one")  # refused by the loop, so this process must say so
    assert is_rank_zero()


# -- mistakes: exit 2, one line, nothing written ----------------------------------------------------


@pytest.fixture
def work(tmp_path, monkeypatch):
    """An empty working folder with a small text, an empty file and a folder."""
    monkeypatch.chdir(tmp_path)
    write_text(tmp_path / "text.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "a-folder").mkdir()
    return tmp_path


EARLY = {
    "missing data": (["--data", "none.txt"], "--data none.txt: no such file"),
    "empty data": (["--data", "empty.txt"], "--data empty.txt: the file is empty"),
    "data is a folder": (["--data", "a-folder"], "--data a-folder: not a file"),
    "unknown preset": (["--preset", "gpt2-smal"], "unknown GPT preset preset='gpt2-smal'"),
    "unknown attention": (["--attention", "flash"], "unknown attention kind 'flash'"),
    "bad K=V": (["--attention-option", "window"], "--attention-option 'window': expected K=V"),
    "context too long": (
        ["--preset", "tiny", "--context-length", "4096"],
        "context_length=4096 is longer than preset 'tiny' allows (context_length=128)",
    ),
    "warmup too long": (["--max-steps", "5", "--warmup", "5"], "--warmup 5 must be shorter than the run's 5 steps"),
    "misspelt kind option": (
        ["--attention", "gqa", "--attention-option", "num_kv_head=2"],
        "attention kind 'gqa' has no option 'num_kv_head' (did you mean 'num_kv_heads'?); its options: ",
    ),
    "unknown kind option": (["--data", "text.txt", "--attention-option", "foo=1"], "'mha' has no option 'foo'"),
    "bad dtype": (["--dtype", "float16"], "dtype='float16'"),
    "out is a file": (["--data", "text.txt", "--out", "text.txt"], "--out text.txt: exists and is not a folder"),
    "resume without checkpoint": (
        ["--data", "text.txt", "--out", "a-folder", "--resume"],
        "--resume: --out a-folder holds no checkpoint",
    ),
    "resume of the default out": (
        ["--preset", "tiny", "--resume", "--max-steps", "70"],
        f"--resume: --out {os.path.join('runs', 'tiny-mha')} holds no checkpoint",
    ),
}


@pytest.mark.parametrize("case", EARLY)
def test_mistakes_are_refused_before_anything_is_written(case, work, capsys):
    argv, message = EARLY[case]
    before = files_under(work)
    line = refused(capsys, "train", *argv)
    assert message in line, line
    assert files_under(work) == before


def test_other_ranks_exit_2_without_repeating_the_line(work, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    rc, out, err = quietly("train", "--preset", "gpt2-smal")
    assert rc == 2 and out == "" and err == ""


# -- a tiny real run through the command line -------------------------------------------------------

TINY = ["--preset", "tiny", "--batch-size", "8", "--eval-batches", "2", "--warmup", "1", "--threads", "1"]


def train_quietly(*argv: str) -> tuple[int, str, str]:
    """``multihead train ARGV`` with stdout and stderr captured (for module-scoped fixtures)."""
    return quietly("train", *argv)


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """(run dir, stdout) of a 5-step byte-level run of the tiny preset on a small text file."""
    folder = tmp_path_factory.mktemp("bytes")
    data = write_text(folder / "text.txt")
    run = folder / "tmp"
    steps = ["--max-steps", "5", "--eval-every", "5", "--checkpoint-every", "5"]
    rc, out, err = train_quietly("--data", str(data), *TINY, *steps, "--out", str(run))
    assert rc == 0, err
    return run, out


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A 2-step run with a 300-token BPE vocabulary learned from the same kind of text."""
    folder = tmp_path_factory.mktemp("bpe")
    data = write_text(folder / "text.txt", seed=1)
    run = folder / "run"
    steps = ["--max-steps", "2", "--eval-every", "2", "--checkpoint-every", "2"]
    rc, out, err = train_quietly(
        "--data", str(data), "--tokenizer", "bpe", "--vocab-size", "300", *TINY, *steps, "--out", str(run)
    )
    assert rc == 0, err
    return run, out


def reference_generation(run: Path, step_dir: Path, prompt: str, new: int, seed: int) -> str:
    """What generate should print, from the library: the step's model and the run's tokenizer."""
    model = load_checkpoint(step_dir).eval()
    tokenizer = load_tokenizer_dir(run / "tokenizer")
    ids = model.generate(torch.tensor([tokenizer.encode(prompt)]), new, generator=torch.Generator().manual_seed(seed))
    return tokenizer.decode(ids[0].tolist())


def test_tiny_run_writes_metrics_checkpoint_and_summary(byte_run):
    from multihead.train.batches import read_tokens, val_batches
    from multihead.train.loop import VAL_SEED

    run, out = byte_run
    assert {"config.json", "metrics.jsonl", "tokenizer", "data/train.bin", "data/val.bin"} <= set(files_under(run))
    config = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    assert config == TrainConfig(**parse("--data", config.data, *TINY, "--max-steps", "5", "--eval-every", "5",
                                         "--checkpoint-every", "5", "--out", str(run)))  # fmt: skip
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["step"] == 5 and math.isfinite(last["train_loss"]) and math.isfinite(last["val_loss"])
    assert json.loads((run / "checkpoints" / "latest").read_text())["directory"] == "step-000005"

    # The checkpoint holds the trained weights: its loss on the fixed validation batches is the logged one.
    model = load_checkpoint(run / "checkpoints" / "step-000005").eval()
    assert model.config.vocab_size == 256 and model.config.context_length == config.context_length
    sets = val_batches(read_tokens(run / "data" / "val.bin"), batch_size=config.batch_size,
                       context_length=config.context_length, num_batches=config.eval_batches, seed=VAL_SEED)  # fmt: skip
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in sets]
    torch.testing.assert_close(torch.stack(losses).mean().item(), last["val_loss"], rtol=1e-5, atol=1e-5)

    lines = out.splitlines()
    assert lines[0] == f"run: {run}"
    printed = re.fullmatch(r"final val loss: (\S+) nats/token = (\S+) bits/byte \(step 5\)", lines[1])
    assert printed, lines[1]
    assert float(printed[1]) == pytest.approx(last["val_loss"], abs=5e-5)
    assert float(printed[2]) == pytest.approx(last["val_loss"] / math.log(2), abs=5e-5)
    assert re.fullmatch(r"speed: [\d,]+ tokens/s .*", lines[2]), lines[2]
    assert lines[3] == f"try: multihead generate --checkpoint {run} 'To be'"


def test_generate_from_a_byte_run_directory(byte_run, capsys):
    run, _ = byte_run
    step_dir = run / "checkpoints" / "step-000005"
    args = ["--max-new-tokens", "20", "--seed", "3"]
    rc, out, err = quietly("generate", "--checkpoint", str(run), "To be", *args)
    assert rc == 0 and "step 5" in err and "bytes tokenizer" in err
    # same model, tokenizer, prompt and generator: the very same operations, so the same text
    assert out == reference_generation(run, step_dir, "To be", 20, 3) + "\n"
    assert out.startswith("To be")
    # the step's model file loads as a plain checkpoint (bytes: no tokenizer needed)
    assert quietly("generate", "--checkpoint", str(step_dir), "--prompt", "To be", *args)[1] == out


def test_generate_from_a_bpe_run_directory(bpe_run, capsys):
    run, out = bpe_run
    assert "bits/byte" not in out and "final val loss:" in out
    step_dir = run / "checkpoints" / "step-000002"
    rc, text, err = quietly("generate", "--checkpoint", str(run), "To be", "--max-new-tokens", "8", "--seed", "1")
    assert rc == 0 and "bpe tokenizer" in err, err
    assert text == reference_generation(run, step_dir, "To be", 8, 1) + "\n"
    assert text.startswith("To be")
    # the step's model alone has a 300-token vocabulary: it needs a tokenizer, and the run's tokenizer.json serves
    line = refused(capsys, "generate", "--checkpoint", str(step_dir), "--prompt", "To be", command="generate")
    assert "vocab_size is 300" in line
    hf = ["--tokenizer", str(run / "tokenizer" / "tokenizer.json"), "--max-new-tokens", "8", "--seed", "1"]
    assert quietly("generate", "--checkpoint", str(step_dir), "--prompt", "To be", *hf)[1] == text


@pytest.mark.parametrize("run_fixture", ["byte_run", "bpe_run"])
def test_inspect_a_run_directory(run_fixture, request, tmp_path, capsys):
    from multihead.commands.inspect import inspect_text

    run, _ = request.getfixturevalue(run_fixture)
    step_dir = max((run / "checkpoints").glob("step-*"))
    bpe = run_fixture == "bpe_run"
    found = inspect_text("To be, or not", checkpoint=str(run))
    assert found.record.source.startswith(f"GPT run {run.name}, step ")
    # the step's model with the run's tokenizer given by hand: the same ids and, from the same
    # operations on the same shapes, the very same weights
    by_hand = inspect_text(
        "To be, or not", checkpoint=str(step_dir), tokenizer=str(run / "tokenizer" / "tokenizer.json") if bpe else None
    )
    assert found.token_ids == by_hand.token_ids and len(found.roles) == len(by_hand.roles)
    for a, b in zip(found.record.layers, by_hand.record.layers):
        assert torch.equal(a.weights, b.weights)
    rc, out, err = quietly("inspect", "To be", "--checkpoint", str(run), "--out", str(tmp_path / "o"))
    assert rc == 0 and (tmp_path / "o" / "heads.json").is_file(), err
    if bpe:
        line = refused(capsys, "inspect", "To be", "--checkpoint", str(run), "--tokenizer",
                       str(run / "tokenizer" / "tokenizer.json"), command="inspect")  # fmt: skip
        assert "is a training run with its own tokenizer" in line


def test_resume_continues_with_the_saved_settings(byte_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(byte_run[0], run)
    # only what changes is given: the rest comes from the run's config.json
    rc, out, err = quietly("train", "--out", str(run), "--resume", "--max-steps", "7")
    assert rc == 0, err
    assert "(step 7)" in out and json.loads((run / "checkpoints" / "latest").read_text())["step"] == 7
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 7 and 5 in steps
    saved = json.loads((run / "config.json").read_text())
    assert saved == {**json.loads((byte_run[0] / "config.json").read_text()), "max_steps": 7, "out": str(run)}


def test_run_mistakes_found_by_the_loop_write_nothing(byte_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(byte_run[0], run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    line = refused(capsys, "train", "--out", str(run), "--resume", "--lr", "0.5")
    saved_lr = json.loads((run / "config.json").read_text())["lr"]
    assert "another config" in line and f"'lr': ({saved_lr!r}, 0.5)" in line, line
    line = refused(capsys, "train", "--data", str(tmp_path), "--out", str(run))
    assert f"--data {tmp_path}: not a file" in line
    data = byte_run[0].parent / "text.txt"
    line = refused(capsys, "train", "--data", str(data), *TINY, "--max-steps", "5", "--out", str(run))
    assert f"{run} already holds a training checkpoint" in line
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

    small = write_text(tmp_path / "small.txt", lines=20)  # about 100 bytes of validation text
    line = refused(capsys, "train", "--data", str(small), *TINY, "--max-steps", "5", "--out", str(tmp_path / "new"))
    assert f"val split of data={str(small)!r}" in line and "128" in line, line
    assert not (tmp_path / "new").exists()
    one = tmp_path / "one.txt"  # catches: a file too small to split reported as a bug in multihead
    one.write_text("hi\n")
    line = refused(capsys, "train", "--data", str(one), *TINY, "--max-steps", "5", "--out", str(tmp_path / "new"))
    assert "one.txt: too small to split" in line and not (tmp_path / "new").exists()


def test_generate_run_directory_mistakes(bpe_run, tmp_path, capsys):
    run, _ = bpe_run
    (tmp_path / "fresh" / "tokenizer").mkdir(parents=True)
    line = refused(capsys, "generate", "--checkpoint", str(tmp_path / "fresh"), command="generate")
    assert f"--checkpoint {tmp_path / 'fresh'}: a training run with no complete checkpoint yet" in line
    tok = run / "tokenizer" / "tokenizer.json"  # a valid tokenizers file, refused beside a run directory
    line = refused(capsys, "generate", "--checkpoint", str(run), "--tokenizer", str(tok), command="generate")
    assert "is a training run with its own tokenizer" in line
    line = refused(capsys, "generate", "--checkpoint", str(run), "To be", "--prompt", "Hi", command="generate")
    assert "give the prompt once, as PROMPT or --prompt (got 'To be' and --prompt 'Hi')" in line
