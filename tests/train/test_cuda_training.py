"""Training on a CUDA device in bfloat16: a resumed run restores the CUDA
generator (dropout) and follows the uninterrupted run; the ``--sample-every``
line decodes on the device and leaves the generators as they were. Runs only where a CUDA
device is present (docs/testing.md lists the paths only a GPU checks)."""

import json
import signal

import pytest
import torch
from support.training import signal_during_steps, tiny_config

from multihead.train import latest_checkpoint, train
from multihead.train.checkpoint import load_training_state
from multihead.train.interrupt import TrainingInterrupted

TEXT = "".join(f"a line of text, number {i % 7}, for the tiny model.\n" for i in range(200))

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_bf16_cuda_resume_restores_the_cuda_generator_and_follows_the_straight_run(tmp_path, monkeypatch):
    values = dict(max_steps=6, warmup=1, checkpoint_every=3, eval_every=3, log_every=1, dropout=0.1, device="cuda",
                  dtype="bfloat16")  # fmt: skip
    signal_during_steps(monkeypatch, {3: [signal.SIGTERM]})  # stops after step 3 of the same 6-step schedule
    with pytest.raises(TrainingInterrupted):
        train(tiny_config(tmp_path / "split", TEXT, **values), progress=False)
    monkeypatch.undo()
    resumed = train(tiny_config(tmp_path / "split", TEXT, **values), resume=True, progress=False)
    straight = train(tiny_config(tmp_path / "straight", TEXT, **values), progress=False)
    split_state = load_training_state(latest_checkpoint(resumed.run_dir))
    straight_state = load_training_state(latest_checkpoint(straight.run_dir))
    assert "cuda.0" in straight_state.rng
    for key in straight_state.rng:  # the same draws in the same order: the same generator states
        assert torch.equal(split_state.rng[key], straight_state.rng[key]), key
    got, want = _metrics(resumed.run_dir), _metrics(straight.run_dir)
    assert [m["step"] for m in got] == [m["step"] for m in want] == list(range(1, 7))
    # CUDA kernels may add in another order between runs (atomics in backward): the resumed run must
    # follow the straight one as closely as a second straight run does, plus a bfloat16 floor
    again = _metrics(train(tiny_config(tmp_path / "again", TEXT, **values), progress=False).run_dir)
    losses = [torch.tensor([m["train_loss"] for m in run]) for run in (got, want, again)]
    spread = float((losses[2] - losses[1]).abs().max())
    assert float((losses[0] - losses[1]).abs().max()) <= 3 * spread + 1e-2 * float(losses[1].abs().max()), losses
    assert next(resumed.model.parameters()).device.type == "cuda"


class _Ids:
    """A tokenizer stand-in whose text is the ids themselves."""

    @staticmethod
    def decode(ids):
        return " ".join(map(str, ids))


def test_cuda_sample_line_decodes_on_the_device_and_leaves_the_generators_and_mode_as_they_were():
    from multihead.models import GPT, GPTConfig
    from multihead.models.generation import generate
    from multihead.train.sampling import PROMPT_TOKENS, SAMPLE_TOKENS, sample_line

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", context_length=16, dropout=0.1), device="cuda").train()
    val = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).numpy()
    cpu_state, cuda_state = torch.get_rng_state(), torch.cuda.get_rng_state()
    line = sample_line(model, _Ids(), val, 7, torch.device("cuda"))
    assert model.training
    assert torch.equal(torch.get_rng_state(), cpu_state) and torch.equal(torch.cuda.get_rng_state(), cuda_state)
    prompt = [int(t) for t in val[:PROMPT_TOKENS]]
    with torch.no_grad():
        ids = generate(model.eval(), torch.tensor([prompt], device="cuda"), SAMPLE_TOKENS, temperature=0.0)
    assert line == f"sample at step 7: {_Ids.decode(prompt)!r} -> {_Ids.decode(ids[0, len(prompt):].tolist())!r}"
