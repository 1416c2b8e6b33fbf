"""Recovery training after head surgery (tools.recovery.recover)."""

from __future__ import annotations

import copy

import pytest
import torch

from multihead.models.gpt import GPT, GPTConfig
from multihead.tools.convert_heads import to_gqa
from multihead.tools.recovery import recover


def _teacher(**overrides) -> GPT:
    """A tiny random GPT whose 2-D weights are scaled up 4x, so that its
    next-token distributions are far from uniform and averaging heads costs
    a clear KL (an untrained model at init is close to uniform everywhere)."""
    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny", num_layers=2, context_length=32, **overrides)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    return model


def _batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, 16), generator=g) for _ in range(n)]


def _logits(model, batch):
    return model(batch)  # (B, T, V)


def _kl_reference(student: GPT, teacher: GPT, batches) -> float:
    """KL(teacher || student) per position, written out in float64 from the
    two models' logits: sum_v p_t (log p_t - log p_s), mean over positions."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x in batches:
            log_t = torch.log_softmax(teacher(x).double(), dim=-1)  # (B, T, V)
            log_s = torch.log_softmax(student(x).double(), dim=-1)
            total += float((log_t.exp() * (log_t - log_s)).sum())
            count += x.numel()
    return total / count


def test_recovery_lowers_the_kl_to_the_teacher_on_held_out_batches():
    teacher = _teacher()
    student = to_gqa(teacher, 1, method="mean")
    train, held_out = _batches(1, 4), _batches(2, 3)
    before = _kl_reference(student, teacher, held_out)
    losses = recover(student, teacher, train, _logits, steps=20, lr=1e-3, progress=False)
    after = _kl_reference(student, teacher, held_out)
    assert before > 0.05  # the conversion lost something to recover
    assert after < 0.7 * before, (before, after)  # measured: 0.103 -> 0.052
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert not any(m.training for m in student.modules())  # left in eval mode
    assert all(p.grad is None for p in student.parameters())


def test_first_loss_is_each_objective_written_out():
    """Step 0's loss is computed before any update: it equals the objective
    written out in float64 on the untouched models (float32 tolerance)."""
    teacher = _teacher()
    batch = _batches(3, 1)
    with torch.no_grad():
        s = to_gqa(teacher, 2, method="mean")
        s_logits, t_logits = s(batch[0]).double(), teacher(batch[0]).double()  # (B, T, V)
        s_emb, t_emb = s_logits.mean(dim=1), t_logits.mean(dim=1)  # (B, T, V) -> (B, V)
    want = {
        "kl": _kl_reference(s, teacher, batch),
        "cosine": float((1 - (s_emb * t_emb).sum(1) / (s_emb.norm(dim=1) * t_emb.norm(dim=1))).mean()),
        "mse": float(((s_logits - t_logits) ** 2).mean()),
    }
    for objective, pooled in (("kl", False), ("cosine", True), ("mse", False)):
        student = copy.deepcopy(s)
        outputs = (lambda m, b: m(b).mean(dim=1)) if pooled else _logits
        got = recover(student, teacher, batch, outputs, steps=1, objective=objective, progress=False)[0]
        # float32 loss against the float64 formula: torch's float32 defaults
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want[objective], dtype=torch.float32))


def test_teacher_is_never_changed_and_keeps_its_modes():
    teacher = _teacher(dropout=0.1)
    teacher.train()
    teacher.blocks[0].eval()  # a mixed set of modes, restored as it was
    modes = [m.training for m in teacher.modules()]
    state = {k: v.clone() for k, v in teacher.state_dict().items()}
    student = to_gqa(teacher, 2, method="mean")
    recover(student, teacher, _batches(1, 2), _logits, steps=3, lr=1e-2, weight_decay=0.1, progress=False)
    after = teacher.state_dict()
    # bitwise: nothing may have written to the teacher's tensors at all
    assert all(torch.equal(state[k], after[k]) for k in state)
    assert all(p.grad is None for p in teacher.parameters())
    assert [m.training for m in teacher.modules()] == modes


def test_same_seed_same_steps_and_the_callers_generator_is_untouched():
    teacher = _teacher(dropout=0.2)
    a, b = to_gqa(teacher, 2, method="mean"), to_gqa(teacher, 2, method="mean")
    rng = torch.get_rng_state()
    first = recover(a, teacher, _batches(1, 2), _logits, steps=4, lr=1e-3, progress=False, seed=5)
    assert torch.equal(torch.get_rng_state(), rng)
    # bitwise: the very same operations on the same shapes with the same dropout draws
    assert recover(b, teacher, _batches(1, 2), _logits, steps=4, lr=1e-3, progress=False, seed=5) == first
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_params_trains_only_the_chosen_parameters():
    teacher = _teacher()
    student = to_gqa(teacher, 1, method="mean")
    chosen = [p for name, p in student.named_parameters() if ".attn." in name]
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    recover(student, teacher, _batches(1, 2), _logits, steps=3, lr=1e-2, params=chosen, progress=False)
    for name, p in student.named_parameters():
        if ".attn." in name:
            assert not torch.equal(p, before[name]), name
        else:  # bitwise: never written
            assert torch.equal(p, before[name]), name


def test_progress_bar_writes_to_stderr(capsys):
    pytest.importorskip("tqdm")
    teacher = _teacher()
    student = to_gqa(teacher, 2, method="mean")
    recover(student, teacher, _batches(1, 1), _logits, steps=2, progress=True)
    assert "recovery" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(steps=0), ValueError, "steps=0"),
        (dict(steps=2.5), ValueError, "steps=2.5"),
        (dict(lr=0.0), ValueError, "lr=0.0"),
        (dict(lr=-1e-3), ValueError, "lr=-0.001"),
        (dict(lr="1e-3"), TypeError, "lr='1e-3'"),
        (dict(objective="l2"), ValueError, "objective='l2'.*'kl', 'cosine', 'mse'"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay=-0.1"),
        (dict(warmup=3), ValueError, "warmup=3 with steps=3"),
        (dict(min_lr=1.0), ValueError, "min_lr=1.0 with lr=0.001"),
        (dict(batches=[]), ValueError, "empty batches"),
        (
            dict(outputs=lambda m, b: m(b)[..., :-1] if m.training else m(b)),
            ValueError,
            r"student \(4, 16, 255\), teacher \(4, 16, 256\)",
        ),  # fmt: skip
        (dict(outputs=lambda m, b: b), TypeError, "torch.int64"),
        (dict(outputs=lambda m, b: m(b).sum()), ValueError, "0-d"),
        (dict(params=[torch.nn.Parameter(torch.ones(3))]), TypeError, r"params\[0\].*shape \(3,\)"),
        (dict(params=[]), ValueError, "params is empty"),
    ],
)
def test_errors_name_the_values(kwargs, error, match):
    teacher = _teacher()
    student = to_gqa(teacher, 2, method="mean")
    args = dict(batches=_batches(1, 1), outputs=_logits, steps=3, lr=1e-3, progress=False)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        recover(student, teacher, **args)


def test_a_student_sharing_the_teachers_parameters_is_refused():
    teacher = _teacher()
    count = len(list(teacher.parameters()))  # each tensor once (the tied embedding too)
    with pytest.raises(ValueError, match=f"share {count} parameter"):
        recover(teacher, teacher, _batches(1, 1), _logits, steps=1, progress=False)
    with pytest.raises(TypeError, match="teacher must be a torch.nn.Module, got str"):
        recover(teacher, "gpt", _batches(1, 1), _logits, steps=1, progress=False)
