"""Rotary position embeddings against a NumPy float64 implementation of the
formulas, against Hugging Face's LLaMA rotary code, and their properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.paths import assert_paths_agree

from multihead.functional.rope import apply_rope, rope_frequencies, rope_options

F64 = torch.float64


def np_rope(x: np.ndarray, positions: np.ndarray, *, base=10000.0, interleaved=False, rotary_dim=None):
    """RoPE from the formulas, pair by pair: x [B, H, T, D], positions [T] or [B, T]."""
    B, H, T, D = x.shape
    r = D if rotary_dim is None else rotary_dim
    pos = np.broadcast_to(positions, (B, T)).astype(np.float64)
    out = x.astype(np.float64).copy()
    for i in range(r // 2):
        theta = base ** (-2.0 * i / r)
        a_idx, b_idx = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
        for b in range(B):
            for t in range(T):
                c, s = np.cos(pos[b, t] * theta), np.sin(pos[b, t] * theta)
                a, bb = x[b, :, t, a_idx], x[b, :, t, b_idx]
                out[b, :, t, a_idx] = a * c - bb * s
                out[b, :, t, b_idx] = bb * c + a * s
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 4])
@pytest.mark.parametrize("batched", [False, True])
def test_matches_numpy_formulas(interleaved, rotary_dim, batched):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 7, 10, dtype=F64, generator=g)
    pos = torch.randint(0, 50, (2, 7), generator=g) if batched else torch.arange(3, 10)
    got = apply_rope(x, pos, interleaved=interleaved, rotary_dim=rotary_dim, base=500.0)
    want = np_rope(x.numpy(), pos.numpy(), interleaved=interleaved, rotary_dim=rotary_dim, base=500.0)
    np.testing.assert_allclose(got.numpy(), want, rtol=0, atol=1e-12)
    if rotary_dim is not None:
        assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:])  # pass-through is untouched


def test_default_positions_and_tables():
    x = torch.randn(1, 2, 5, 6, dtype=F64)
    assert torch.equal(apply_rope(x), apply_rope(x, torch.arange(5)))
    cos, sin = rope_frequencies(6, 5, dtype=F64)
    assert cos.shape == sin.shape == (5, 3)
    angles = np.arange(5)[:, None] * 10000.0 ** (-np.arange(0, 6, 2) / 6)
    np.testing.assert_allclose(cos.numpy(), np.cos(angles), atol=1e-15)
    np.testing.assert_allclose(sin.numpy(), np.sin(angles), atol=1e-15)
    assert rope_frequencies(6, torch.zeros(2, 4))[0].shape == (2, 4, 3)
    assert rope_frequencies(6, 3)[0].dtype == torch.float32


@pytest.mark.parametrize("base", [10000.0, 500000.0])
def test_matches_hugging_face_llama(base):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=2, vocab_size=16,
        num_hidden_layers=1, intermediate_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    D = 12
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 9, D, generator=g), torch.randn(2, 2, 9, D, generator=g)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 2, 3, 4, 5, 1000]])
    cos, sin = LlamaRotaryEmbedding(config)(q, position_ids)
    q_hf, k_hf = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rope(q, position_ids, base=base), q_hf)
    torch.testing.assert_close(apply_rope(k, position_ids, base=base), k_hf)


@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_depend_only_on_position_difference(interleaved):
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 1, 8, dtype=F64, generator=g), torch.randn(1, 2, 1, 8, dtype=F64, generator=g)
    scores = []
    for m, n in [(3, 1), (10, 8), (102, 100)]:  # m - n = 2 each time
        qm = apply_rope(q, torch.tensor([m]), interleaved=interleaved)
        kn = apply_rope(k, torch.tensor([n]), interleaved=interleaved)
        scores.append((qm * kn).sum(-1))
    torch.testing.assert_close(scores[0], scores[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(scores[0], scores[2], rtol=0, atol=1e-12)
    q0 = apply_rope(q, torch.tensor([5]), interleaved=interleaved)
    assert not torch.allclose((q0 * apply_rope(k, torch.tensor([4]))).sum(-1), scores[0])


def test_norm_preserved():
    x = torch.randn(2, 3, 11, 8, dtype=F64)
    y = apply_rope(x, torch.arange(11) * 37)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=0, atol=1e-12)


def test_interleaved_is_rotate_half_after_permutation():
    D = 10
    perm = torch.tensor([*range(0, D, 2), *range(1, D, 2)])  # interleaved channel -> rotate-half slot
    x = torch.randn(2, 3, 7, D, dtype=F64)
    pos = torch.arange(7) + 4
    inter = apply_rope(x, pos, interleaved=True)
    half = apply_rope(x[..., perm], pos)
    assert_paths_agree(inter[..., perm], half)  # other memory layouts: compared within tolerance


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_computes_in_float32(dtype):
    x = torch.randn(1, 2, 4, 8, dtype=F64).to(dtype)
    pos = torch.tensor([0, 1, 3000, 60000])  # 60000 is not even representable in bfloat16
    got = apply_rope(x, pos)
    assert got.dtype == dtype
    assert torch.equal(got, apply_rope(x.float(), pos).to(dtype))
    small = torch.arange(4) * 7
    err = (apply_rope(x, small).double() - apply_rope(x.double(), small)).abs().max().item()
    assert err <= torch.finfo(dtype).eps * x.double().abs().max().item()


def test_gradients():
    x = torch.randn(1, 2, 3, 6, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, torch.tensor([2, 5, 9]), rotary_dim=4), (x,))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda x: apply_rope(x, rotary_dim=3), ValueError, "rotary_dim=3"),
        (lambda x: apply_rope(x, rotary_dim=8), ValueError, "head_dim=6"),
        (lambda x: apply_rope(x, torch.arange(4)), ValueError, r"\[T\] = \[5\]"),
        (lambda x: apply_rope(x, torch.zeros(3, 5)), ValueError, r"\[2, 5\]"),
        (lambda x: apply_rope(x, torch.ones(5, dtype=torch.bool)), TypeError, "torch.bool"),
        (lambda x: apply_rope(x[0]), ValueError, r"\[B, H, T, D\]"),
        (lambda x: apply_rope(x, base=1.0), ValueError, "base=1.0"),
        (lambda x: apply_rope(x, interleaved=1), TypeError, "interleaved"),
        (lambda x: apply_rope(x[..., :5]), ValueError, "explicit even rotary_dim"),
        (lambda x: rope_frequencies(5, 3), ValueError, "head_dim=5"),
        (lambda x: rope_frequencies(4, 3, dtype=torch.float16), ValueError, "float16"),
        (lambda x: rope_options({"theta": 3.0}, 6), ValueError, "theta"),
        (lambda x: rope_options("yes", 6), TypeError, "rope"),
    ],
)
def test_errors(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(2, 3, 5, 6))


def test_rope_options():
    assert rope_options(False, 8) is None
    assert rope_options(True, 8) == {"base": 10000.0, "interleaved": False, "rotary_dim": 8}
    assert rope_options({"rotary_dim": 4, "interleaved": True}, 8)["rotary_dim"] == 4
