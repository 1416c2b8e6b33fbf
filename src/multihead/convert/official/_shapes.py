"""The check every converter makes before loading: the official state dict holds exactly
the expected names, each with its expected shape."""

from __future__ import annotations

import torch

__all__ = ["check_official_shapes"]


def check_official_shapes(state_dict: dict[str, torch.Tensor], want: dict[str, tuple[int, ...]]) -> None:
    """ValueError naming the missing, unexpected and misshapen entries of ``state_dict``
    against ``want`` (name -> shape)."""
    missing, unexpected = sorted(set(want) - set(state_dict)), sorted(set(state_dict) - set(want))
    if missing or unexpected:
        raise ValueError(f"state_dict does not fit the configuration: missing {missing}, unexpected {unexpected}; "
                         f"expected {sorted(want)}")  # fmt: skip
    wrong = {k: tuple(state_dict[k].shape) for k in want if tuple(state_dict[k].shape) != want[k]}
    if wrong:
        raise ValueError(f"official parameter shapes {wrong} do not fit the configuration: expected "
                         f"{ {k: want[k] for k in wrong} }")  # fmt: skip
