"""``GPT(idx, targets)`` (nanoGPT's convention) and ``GPT(idx, labels=...)`` (Hugging Face's), and
``load_checkpoint`` of a training run directory.

References: transformers' GPT2LMHeadModel computing its own loss from ``labels`` on the same
weights, and a log-softmax written out here (different operations: float32 tolerances).
"""

from __future__ import annotations

import pytest
import torch
from support.paths import assert_paths_agree

from multihead.models import LMOutput
from multihead.models.gpt import GPT, GPTConfig

V = 97


def gpt(dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=V, context_length=32, embed_dim=32, num_layers=2, num_heads=4), dtype=dtype).eval()


def reference_loss(logits: torch.Tensor, want: torch.Tensor, ignore: int) -> torch.Tensor:
    """Mean of -log softmax(logits)[want] over the positions whose want is not ``ignore``."""
    logp = logits.double().log_softmax(-1)  # (B, T, V)
    keep = want != ignore
    picked = logp.gather(-1, want.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    return -(picked[keep]).mean().to(logits.dtype)


def test_targets_as_nanogpt_unpack_to_logits_and_loss():
    model = gpt()
    g = torch.Generator().manual_seed(1)
    idx, targets = torch.randint(0, V, (3, 10), generator=g), torch.randint(0, V, (3, 10), generator=g)
    targets[1, 4:] = -1  # nanoGPT's ignored value
    with torch.no_grad():
        logits, loss = model(idx, targets)
        out = model(idx, targets=targets)
        plain = model(idx)
    assert isinstance(out, LMOutput) and out.loss is out[1]
    assert torch.equal(logits, plain) and loss.dim() == 0  # the same forward, plus the loss
    assert_paths_agree(loss, reference_loss(plain, targets, -1))
    assert_paths_agree(out.loss, loss)


def test_labels_as_hugging_face_match_gpt2lmheadmodel():
    pytest.importorskip("transformers")
    from support.hf_gpt2 import hf_model, ours_from

    hf = hf_model()
    model = ours_from(hf)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 97, (2, 12), generator=g)
    labels = idx.clone()
    labels[0, :5] = -100  # a prompt left out of the loss
    with torch.no_grad():
        ours, theirs = model(idx, labels=labels), hf(idx, labels=labels)
        plain = model(idx)
    assert_paths_agree(ours.loss, theirs.loss)
    assert_paths_agree(ours.logits, theirs.logits)
    # shifted inside: the same as targets = labels moved one left, the last position ignored
    assert_paths_agree(ours.loss, reference_loss(plain[:, :-1], labels[:, 1:], -100))


def test_half_logits_give_a_float32_loss_and_all_ignored_gives_nan():
    model = gpt(torch.bfloat16)
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(idx, labels=idx)
        assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
        assert torch.isnan(model(idx, torch.full_like(idx, -1)).loss)


def test_wrong_targets_or_labels_are_refused_before_the_model_runs():
    model = gpt()
    idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(4))
    caches = model.make_kv_caches(2, 16)
    cases = [
        ({"targets": idx, "labels": idx}, ValueError, "give targets .* or labels .*, not both"),
        ({"targets": idx.float()}, TypeError, "targets must hold integer token ids, got dtype torch.float32"),
        ({"labels": idx[:, :5]}, ValueError, r"labels must be \(B, T\) = \(2, 6\) like idx, got \(2, 5\)"),
        ({"targets": idx + V}, ValueError, rf"targets must be token ids in \[0, {V}\) or -1 \(ignored\)"),
        ({"labels": torch.full_like(idx, -1)}, ValueError, r"or -100 \(ignored\), got -1"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            model(idx, kv_caches=caches, **kwargs)
        assert all(c.length == 0 for c in caches)


def test_load_checkpoint_reads_a_run_directory(tmp_path):
    from support.training import latest, tiny_config

    from multihead.models.checkpoint import load_checkpoint, read_config
    from multihead.train.loop import train

    config = tiny_config(tmp_path, "To be, or not to be, that is the question.\n" * 20, max_steps=2,
                         eval_every=2, checkpoint_every=2, batch_size=4, warmup=1)  # fmt: skip
    train(config)
    run = tmp_path / "run"
    got, want = load_checkpoint(run).eval(), latest(run)
    for name, value in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], value), name
    assert read_config(run) == want.config
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"empty is a training run with no complete checkpoint yet"):
        load_checkpoint(empty)


def test_logits_to_keep_computes_the_lm_head_only_where_asked():
    """The last N positions' logits equal the full forward's; the LM head's product shrinks to N rows."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset("tiny", vocab_size=37, context_length=16), dtype=torch.float64).eval()
    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        with FlopCounterMode(display=False) as counter:
            last = model(idx, logits_to_keep=1)
        with FlopCounterMode(display=False) as all_counter:
            model(idx)
    torch.testing.assert_close(last, full[:, -1:], rtol=0, atol=1e-12)
    C, V = model.config.embed_dim, model.config.vocab_size
    assert all_counter.get_total_flops() - counter.get_total_flops() == 2 * 2 * 8 * C * V  # 8 positions fewer
    torch.testing.assert_close(model(idx, logits_to_keep=3), full[:, -3:], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="logits_to_keep=1 keeps part of the logits"):
        model(idx, idx, logits_to_keep=1)
    with pytest.raises(ValueError, match="logits_to_keep must be >= 0"):
        model(idx, logits_to_keep=-1)
