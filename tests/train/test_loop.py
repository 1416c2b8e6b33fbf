"""The training loop: losses, aux terms, bfloat16, schedule, weight decay,
metrics, checkpoint files, progress output and the errors of ``train``."""

import io
import json
import math

import pytest
import torch
from support.training import tiny_config as support_tiny_config
from torch import nn

from multihead.models import GPT, GPTConfig
from multihead.models.checkpoint import load_checkpoint
from multihead.train import TrainConfig, learning_rate, load_training_state, parameter_groups, train
from multihead.train.progress import Progress

TEXT = "".join(f"the quick brown fox {i % 7} jumps over the lazy dog.\n" for i in range(300))


def tiny_config(tmp_path, **overrides) -> TrainConfig:
    """A 2-layer, 64-wide byte model on a repetitive text; one thread."""
    values = dict(
        batch_size=4, max_steps=20, lr=3e-3, min_lr=3e-4,
        warmup=2, eval_every=5, log_every=2, checkpoint_every=5,
    )
    return support_tiny_config(tmp_path, TEXT, **{**values, **overrides})


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("loop")
    config = tiny_config(tmp)
    return config, train(config, progress=False)


def test_loss_decreases_on_repetitive_text(run):
    config, result = run
    metrics = read_metrics(result.run_dir)
    # The untrained model predicts about uniformly over 256 bytes: ln 256 = 5.55 nats.
    assert metrics[0]["train_loss"] < math.log(256) + 0.1
    val = [m["val_loss"] for m in metrics if "val_loss" in m]  # steps 5, 10, 15, 20
    assert len(val) == 4 and val == sorted(val, reverse=True)
    assert result.val_loss < math.log(256) - 2.0  # after 20 steps on a 7-line cycle
    assert result.steps == config.max_steps == metrics[-1]["step"]
    assert result.val_loss == metrics[-1]["val_loss"]
    assert result.train_loss == metrics[-1]["train_loss"]
    assert result.tokens_per_s > 0


def test_metrics_lines_and_fields(run):
    config, result = run
    metrics = read_metrics(result.run_dir)
    # logged: every log_every (2) steps, and the evaluation steps (every 5) and the last
    assert [m["step"] for m in metrics] == [2, 4, 5, 6, 8, 10, 12, 14, 15, 16, 18, 20]
    for m in metrics:
        evaluated = m["step"] % config.eval_every == 0
        keys = {"step", "train_loss", "aux_loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s"}
        assert set(m) == keys | ({"val_loss"} if evaluated else set())
        assert m["lr"] == learning_rate(m["step"] - 1, config)  # the same float formula: exact
        assert m["aux_loss"] == 0.0  # mha has no training term
        assert m["grad_norm"] > 0 and m["tokens_per_s"] > 0
    elapsed = [m["elapsed_s"] for m in metrics]
    assert elapsed == sorted(elapsed)


def test_checkpoint_layout_and_latest_pointer(run):
    config, result = run
    run_dir = result.run_dir
    assert json.loads((run_dir / "config.json").read_text()) == config.to_dict()
    assert sorted(p.name for p in (run_dir / "data").iterdir()) == ["train.bin", "val.bin"]
    assert (run_dir / "tokenizer" / "tokenizer_meta.json").is_file()
    checkpoints = run_dir / "checkpoints"
    # every 5 steps; the last two kept
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-000015", "step-000020"]
    pointer = json.loads((checkpoints / "latest").read_text())
    assert pointer == {"format": "multihead.train-latest", "step": 20, "directory": "step-000020"}
    for name in ("model.safetensors", "state.safetensors"):
        assert (checkpoints / "step-000020" / name).is_file()
    leftovers = [p for p in run_dir.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


def test_checkpoint_model_loads_with_load_checkpoint(run):
    config, result = run
    model = load_checkpoint(result.run_dir / "checkpoints" / "step-000020")
    assert model.config == result.model.config
    trained = result.model.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, trained[name]), name  # a stored copy of the same tensors: bitwise
    state = load_training_state(result.run_dir / "checkpoints" / "step-000020")
    assert state.step == 20 and state.config == config and state.world_size == 1
    assert state.tokens_seen == 20 * config.batch_size * config.context_length
    assert set(state.rng) == {"cpu.0"}


def test_weight_decay_only_on_linear_weights():
    model = GPT(GPTConfig.from_preset("tiny"))
    names = {id(p): n for n, p in model.named_parameters()}
    decay, rest = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    decayed = {names[id(p)] for p in decay["params"]}
    kept = {names[id(p)] for p in rest["params"]}
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    linear.discard("lm_head.weight")  # tied to the token embedding: listed under that name
    assert decayed == linear
    assert "token_embedding.weight" in kept and "position_embedding.weight" in kept
    assert all(n.endswith(".bias") or ".ln_" in n or n.startswith("ln_f") or "embedding" in n for n in kept)
    assert len(decayed) + len(kept) == len(list(model.parameters()))  # each tensor once


def test_the_optimizer_uses_those_groups(run):
    config, result = run
    state = load_training_state(result.run_dir / "checkpoints" / "step-000020")
    decay, rest = parameter_groups(result.model, config.weight_decay)
    groups = state.optimizer["param_groups"]
    assert [g["weight_decay"] for g in groups] == [config.weight_decay, 0.0]
    assert [len(g["params"]) for g in groups] == [len(decay["params"]), len(rest["params"])]
    assert groups[0]["betas"] == (config.beta1, config.beta2)


def test_learning_rate_schedule():
    config = TrainConfig(max_steps=101, warmup=10, lr=1e-3, min_lr=1e-4, preset="tiny")
    assert learning_rate(0, config) == pytest.approx(1e-4, rel=1e-12)  # lr / warmup
    assert learning_rate(9, config) == pytest.approx(1e-3, rel=1e-12)  # end of warm-up: the peak
    assert learning_rate(10, config) == pytest.approx(1e-3, rel=1e-12)  # start of the cosine
    assert learning_rate(55, config) == pytest.approx(5.5e-4, rel=1e-12)  # halfway: (lr + min_lr) / 2
    assert learning_rate(100, config) == pytest.approx(1e-4, rel=1e-12)  # the last step: min_lr
    assert learning_rate(500, config) == 1e-4
    values = [learning_rate(s, config) for s in range(101)]
    assert values[:10] == sorted(values[:10]) and values[10:] == sorted(values[10:], reverse=True)


@pytest.mark.parametrize("attention, options", [("moh", {"shared_heads": 2}), ("gated", {})])
def test_aux_loss_is_logged_for_kinds_with_a_training_term(tmp_path, attention, options):
    config = tiny_config(tmp_path, attention=attention, attention_options=options, max_steps=3, log_every=1)
    result = train(config, progress=False)
    metrics = read_metrics(result.run_dir)
    assert len(metrics) == 3
    assert all(m["aux_loss"] > 0 and math.isfinite(m["train_loss"]) for m in metrics)


def test_grad_accum_matches_one_large_batch(tmp_path):
    one = train(tiny_config(tmp_path / "a", max_steps=4, log_every=1), progress=False)
    two = train(tiny_config(tmp_path / "b", max_steps=4, log_every=1, grad_accum=2), progress=False)
    a, b = read_metrics(one.run_dir), read_metrics(two.run_dir)
    # the same global batch, summed in two halves: float32 rounding apart
    torch.testing.assert_close(torch.tensor([m["train_loss"] for m in b]), torch.tensor([m["train_loss"] for m in a]))
    for (name, p), q in zip(one.model.named_parameters(), two.model.parameters()):
        torch.testing.assert_close(q, p, msg=name)


def test_bfloat16_autocast_runs(tmp_path):
    fp32 = train(tiny_config(tmp_path / "a", max_steps=3, log_every=1), progress=False)
    bf16 = train(tiny_config(tmp_path / "b", max_steps=3, log_every=1, dtype="bfloat16"), progress=False)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    a, b = read_metrics(fp32.run_dir), read_metrics(bf16.run_dir)
    # step 1 is the same initial model on the same batch; bfloat16 keeps ~3 significant digits
    assert b[0]["train_loss"] == pytest.approx(a[0]["train_loss"], rel=2e-2)
    assert b[0]["train_loss"] != a[0]["train_loss"]  # autocast really ran
    assert math.isfinite(bf16.val_loss)


def test_progress_plain_lines_when_not_a_terminal(tmp_path, capsys):
    train(tiny_config(tmp_path, max_steps=4, eval_every=4, checkpoint_every=4), progress=None)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 2/4", "step 4/4"]
    assert "val " in lines[-1] and "tok/s" in lines[-1] and "eta" in lines[-1]
    train(tiny_config(tmp_path, max_steps=6, eval_every=4, checkpoint_every=4), resume=True, progress=False)
    assert capsys.readouterr().err == ""


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal():
    stream = _Terminal()
    bar = Progress(10, 0, stream=stream)
    for step in range(1, 11):
        bar.update(step, 2.5, 1000.0, val_loss=2.25 if step == 10 else None, logged=True)
    bar.close()
    out = stream.getvalue()
    assert "step 10/10" in out and "val 2.2500" in out


def test_errors_name_the_values(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"context_length=512 .*preset 'tiny'.*context_length=128"):
        TrainConfig(preset="tiny", context_length=512)
    with pytest.raises(ValueError, match=r"batch_size=6 and grad_accum=4"):
        TrainConfig(preset="tiny", batch_size=6, grad_accum=4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"batch_size=6 is not divisible by world_size \* grad_accum = 2 \* 2 = 4"):
        train(tiny_config(tmp_path, batch_size=6, grad_accum=2), progress=False)
    monkeypatch.delenv("WORLD_SIZE")
    small = tmp_path / "small.txt"
    small.write_text("abcdefgh\n" * 9 + "xyz\n", encoding="utf-8")  # 4 validation tokens
    with pytest.raises(ValueError, match=r"val split .*batch larger than the data.*context_length=16"):
        train(tiny_config(tmp_path, data=str(small)), progress=False)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    with pytest.raises(ValueError, match=r"cannot resume: no checkpoint in .*run"):
        train(tiny_config(tmp_path), resume=True, progress=False)


def test_one_step_is_adamw_on_the_lm_loss_plus_the_aux_loss(tmp_path):
    """A training step written out by hand (MoH: a load-balance term; clipping at 1.0) gives the
    same weights (catches: the aux loss subtracted, dropped or scaled, another clip or optimizer)."""
    from multihead.train.batches import Batches, read_tokens

    config = tiny_config(tmp_path, attention="moh", attention_options={"shared_heads": 2}, max_steps=1, warmup=0)
    result = train(config, progress=False)
    torch.manual_seed(config.seed)  # as train builds its model
    model = GPT(config.model_config(256)).train()
    tokens = read_tokens(result.run_dir / "data" / "train.bin")
    x, y = Batches(tokens, batch_size=config.batch_size, context_length=config.context_length, seed=config.seed).get(0)
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=learning_rate(0, config),
                                  betas=(config.beta1, config.beta2), eps=1e-8, fused=False)  # fmt: skip
    logits = model(x)
    lm = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    (lm + model.aux_loss()).backward()
    torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], config.grad_clip)
    optimizer.step()
    for (name, p), q in zip(model.named_parameters(), result.model.parameters()):
        torch.testing.assert_close(q, p, msg=name)
