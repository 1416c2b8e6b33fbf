"""Weights from official implementations into multihead modules.

    module = multihead.convert.from_official("moh_dit", state_dict, dim=384, num_heads=6, ...)

``kind`` names an official code base; ``state_dict`` uses its parameter
names and ``official_config`` its constructor's argument names. The returned
module's forward takes the official module's inputs and returns what it
returns, computed by multihead's module for that attention kind. Each kind's
converter lives in ``multihead.convert.<module>``, imported on first use.

Whole models have their own converters beside them: ``multihead.convert.hf_gpt2``
maps Hugging Face GPT-2 state dicts to and from a multihead ``GPT``. Models
never import converters; converters import models.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch
from torch import nn

__all__ = ["from_official", "official_kinds"]

# official kind -> module with ``from_official(state_dict, **official_config)``
_CONVERTERS: dict[str, str] = {
    "moh_dit": "multihead.convert.moh",
    "dcformer": "multihead.convert.dcformer",
    "mohsa_vit": "multihead.convert.mohsa",
    "collaborative": "multihead.convert.collaborative",
    "annotated_transformer": "multihead.convert.annotated",
    "deepseek_v3_mla": "multihead.convert.deepseek_mla",
}


def official_kinds() -> list[str]:
    """The kinds ``from_official`` accepts (those whose converter is installed)."""
    return sorted(k for k, m in _CONVERTERS.items() if importlib.util.find_spec(m) is not None)


def from_official(kind: str, state_dict: dict[str, torch.Tensor], **official_config: Any) -> nn.Module:
    """Build the multihead equivalent of an official attention module.

    Raises:
        ValueError: unknown kind (listing the known ones), or a state dict /
            config that does not match the official layout.
    """
    if kind not in official_kinds():
        raise ValueError(f"unknown official kind {kind!r}; known: {official_kinds()}")
    return importlib.import_module(_CONVERTERS[kind]).from_official(state_dict, **official_config)
