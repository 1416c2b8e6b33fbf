"""Comparing two code paths that compute the same function.

Two paths (a batch vs one row, fused vs split, cached vs full, one module
kind vs another) run different operations or shapes, and BLAS libraries
round them differently on different CPUs (MKL on Intel vs AMD, one thread vs
many). They are compared with the tolerance policy of docs/testing.md, never
bitwise. Greedy decoding is discrete: two paths may pick different tokens
only where the two best logits tie to within that tolerance.
"""

from __future__ import annotations

import torch

__all__ = ["assert_matches_peer", "assert_paths_agree", "assert_greedy_agrees", "assert_cached_generation_agrees"]


def _tolerances(dtype: torch.dtype, scale: float) -> dict[str, float]:
    if dtype == torch.float64:
        return {"rtol": 0.0, "atol": 1e-12 * scale}
    if dtype == torch.float32:
        return {"rtol": 1.3e-6, "atol": 1e-5 * scale}
    return {}  # torch.testing's defaults for the dtype


def assert_paths_agree(got: torch.Tensor, want: torch.Tensor, msg: str | None = None) -> None:
    """float64 within 1e-12 and float32 within torch.testing's defaults, both
    scaled by max(1, max |want|); NaN must match NaN."""
    finite = want[torch.isfinite(want)]
    scale = max(1.0, float(finite.detach().abs().max())) if finite.numel() else 1.0
    torch.testing.assert_close(got, want, equal_nan=True, msg=msg, **_tolerances(want.dtype, scale))


def assert_greedy_agrees(
    tokens: torch.Tensor,
    ref_tokens: torch.Tensor,
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    start: int,
    tie: float | None = None,
) -> None:
    """Greedy results of two paths agree up to float rounding.

    Args:
        tokens, ref_tokens: [B, start + N] (and N' for the reference).
        logits, ref_logits: [B, N, V], the logits each generated token was chosen from.
        start: length of the prompt, equal in both.
        tie: largest gap between the two paths' picks, in logits, that counts
            as a tie (default: 1e-9 for float64, 1e-4 for float32).

    The tokens must be equal; where they first differ, each differing row
    must have picked between two logits within ``tie`` of each other, and
    the logits must agree up to and including that step.
    """
    assert torch.equal(tokens[:, :start], ref_tokens[:, :start]), "prompts differ"
    new, ref_new = tokens[:, start:], ref_tokens[:, start:]
    n = min(new.shape[1], ref_new.shape[1])
    differ = (new[:, :n] != ref_new[:, :n]).any(dim=0).nonzero()
    if differ.numel() == 0:
        assert new.shape == ref_new.shape, (tuple(new.shape), tuple(ref_new.shape))
        assert_paths_agree(logits, ref_logits)
        return
    step = int(differ[0])
    assert_paths_agree(logits[:, : step + 1], ref_logits[:, : step + 1])
    if tie is None:
        tie = 1e-9 if logits.dtype == torch.float64 else 1e-4
    for row in (new[:, step] != ref_new[:, step]).nonzero().flatten().tolist():
        a, b = int(new[row, step]), int(ref_new[row, step])
        gap = float((logits[row, step, a] - logits[row, step, b]).abs())
        assert gap <= tie, f"greedy paths differ at step {step}, row {row}: tokens {a} vs {b}, logit gap {gap:.3e}"


def assert_cached_generation_agrees(model, idx: torch.Tensor, max_new_tokens: int, **kwargs) -> torch.Tensor:
    """Greedy ``model.generate`` with and without the KV cache agree; returns the cached tokens."""
    with torch.no_grad():
        tokens, logits = model.generate(idx, max_new_tokens, temperature=0, return_logits=True, **kwargs)
        ref, ref_logits = model.generate(
            idx, max_new_tokens, temperature=0, return_logits=True, use_cache=False, **kwargs
        )
    assert_greedy_agrees(tokens, ref, logits, ref_logits, start=idx.shape[1])
    return tokens


def assert_matches_peer(actual: torch.Tensor | None, expected: torch.Tensor | None, what: str = "") -> None:
    """multihead vs a peer implementation (torch's own module): None where the
    peer gives None, float64 within 1e-10 scaled by magnitude, other dtypes
    within torch.testing's defaults."""
    if expected is None:
        assert actual is None, what
        return
    assert actual is not None and actual.shape == expected.shape, what
    if expected.dtype == torch.float64:
        scale = max(1.0, expected.abs().max().item())
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-10 * scale, msg=lambda m: f"{what}: {m}")
    else:
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")
