"""``to_gqa(method="aligned")`` beyond two exact rotations: the greedy grouping
used from 16 heads up, the generalized Procrustes mean on heads that are not
rotations of each other, and the real MiniLM, where aligning must beat "mean"."""

from __future__ import annotations

import random

import torch

from multihead.models.gpt import GPT, GPTConfig
from multihead.models.minilm import load_minilm
from multihead.tools import convert_heads
from multihead.tools.convert_heads import to_gqa
from tests.support.paths import assert_paths_agree

F64 = torch.float64


def _rotation(D: int, seed: int) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(D, D, dtype=F64, generator=torch.Generator().manual_seed(seed)))
    return q * torch.sign(torch.diagonal(r))  # orthogonal [D, D]


def _sixteen_heads_in_planted_groups(size: int) -> tuple[GPT, list[list[int]]]:
    """A 16-head model whose heads fall into shuffled groups of ``size``: inside
    a group, keys and values are exact rotations of the group's first head's."""
    torch.manual_seed(0)
    config = GPTConfig.from_preset("tiny", num_layers=1, num_heads=16, embed_dim=128, context_length=32)
    model = GPT(config, dtype=F64).eval()
    H, D = 16, 8
    heads = list(range(H))
    random.Random(3).shuffle(heads)
    groups = [sorted(heads[i : i + size]) for i in range(0, H, size)]
    with torch.no_grad():
        for name in ("k", "v"):
            w, b = model.blocks[0].attn.projection_weights()[name]
            w, b = w.view(H, D, -1), b.view(H, D)  # (H*D, C) -> (H, D, C)
            for g in groups:
                for h in g[1:]:
                    R = _rotation(D, 10 * h + (name == "v"))
                    w[h] = R.T @ w[g[0]]  # x W_h^T = (x W_ref^T) R
                    b[h] = R.T @ b[g[0]]
    return model, groups


def test_sixteen_heads_use_the_greedy_grouping_and_find_the_planted_groups():
    """catches: a greedy pass that adds the farthest heads instead of the closest
    (16 heads in pairs or fours have millions of partitions: the exhaustive
    search is skipped)."""
    for size in (2, 4):
        model, groups = _sixteen_heads_in_planted_groups(size)
        assert convert_heads._count_partitions(16, size) > convert_heads._EXHAUSTIVE_LIMIT
        idx = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
        calibration = [torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(2))]
        with torch.no_grad():
            want = model(idx)
            got = to_gqa(model, 16 // size, method="aligned", calibration=calibration)(idx)
            mean = to_gqa(model, 16 // size)(idx)
        assert float((mean - want).abs().max()) > 1e-3  # the planted groups are not consecutive
        assert_paths_agree(got, want)  # exact: each planted group was found and aligned


def _dispersion(data: torch.Tensor, rotations: torch.Tensor) -> float:
    """sum_i |X_i R_i - mean_j X_j R_j|^2 for data [n, N, D] and rotations [n, D, D]."""
    rotated = data @ rotations
    return float((rotated - rotated.mean(0)).pow(2).sum())


def test_generalized_procrustes_rotates_onto_the_mean_not_onto_the_first_head():
    """catches: a generalized Procrustes that never moves its target from the first head."""
    data = torch.randn(4, 50, 6, dtype=F64, generator=torch.Generator().manual_seed(5))  # not rotations of each other
    rotations = convert_heads._generalized_procrustes(data)
    eye = torch.eye(6, dtype=F64)
    torch.testing.assert_close(rotations @ rotations.transpose(1, 2), eye.expand(4, 6, 6))  # orthogonal
    # the fixed point: each head's rotation is the best one onto the mean of the rotated heads
    mean = (data @ rotations).mean(0)
    for i in range(4):
        U, _, Vh = torch.linalg.svd(data[i].T @ mean)  # orthogonal Procrustes, written out
        torch.testing.assert_close(rotations[i], U @ Vh, rtol=0, atol=1e-3)  # linear convergence: 1e-5 here
    onto_first = torch.stack([convert_heads._procrustes(data[i], data[0]) for i in range(4)])
    assert _dispersion(data, rotations) < 0.99 * _dispersion(data, onto_first)


def test_aligned_keeps_the_real_minilm_closer_to_itself_than_mean():
    """catches: an alignment that does not align (the paper's claim, on held-out sentences)."""
    model = load_minilm()
    calibration = [
        ["To be, or not to be: that is the question.", "Now is the winter of our discontent."],
        ["The quick brown fox jumps over the lazy dog.", "It was the best of times, it was the worst of times."],
    ]
    held_out = ["A journey of a thousand miles begins with a single step.", "I think, therefore I am."]
    want = model.encode(held_out)  # (2, 384), L2-normalised
    mean = to_gqa(model, 6).encode(held_out)
    aligned = to_gqa(model, 6, method="aligned", calibration=calibration).encode(held_out)
    cos_mean, cos_aligned = (mean * want).sum(-1), (aligned * want).sum(-1)
    assert bool((cos_aligned > cos_mean + 0.05).all()), (cos_aligned, cos_mean)
