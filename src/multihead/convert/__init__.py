"""Weights from official implementations into multihead modules.

    module = multihead.convert.from_official("moh_dit", state_dict, dim=384, num_heads=6, ...)

``kind`` names an official code base; ``state_dict`` uses its parameter
names and ``official_config`` its constructor's argument names. The returned
module computes the official forward with multihead's module for that
attention kind: either that module itself, or a thin wrapper whose forward
takes what the official one takes (its docstring says which, and how
positions and caches are passed where they differ). The converter of the
official code base ``kind`` is the module ``multihead.convert.official.<kind>``
(its ``from_official(state_dict, **official_config)``), imported on first
use: adding a file there adds a kind, with no list to edit.

Whole models have their own converters beside them: ``multihead.convert.hf_gpt2``
maps Hugging Face GPT-2 state dicts to and from a multihead ``GPT``. Models
never import converters; converters import models.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

import torch
from torch import nn

from . import official

__all__ = ["from_official", "official_kinds"]


def official_kinds() -> list[str]:
    """The kinds ``from_official`` accepts: the modules of ``multihead.convert.official``."""
    return sorted(m.name for m in pkgutil.iter_modules(official.__path__) if not m.name.startswith("_"))


def from_official(kind: str, state_dict: dict[str, torch.Tensor], **official_config: Any) -> nn.Module:
    """Build the multihead equivalent of an official attention module.

    Raises:
        ValueError: unknown kind (listing the known ones), or a state dict /
            config that does not match the official layout.
    """
    if kind not in official_kinds():
        raise ValueError(f"unknown official kind {kind!r}; known: {official_kinds()}")
    return importlib.import_module(f"{official.__name__}.{kind}").from_official(state_dict, **official_config)
