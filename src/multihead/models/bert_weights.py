"""Hugging Face BERT weights for ``models.bert.BertEncoder``: the key map and the file reader.

    hf_name_map(encoder)                  ours -> (transformers name, shape), every parameter
    load_hf_weights(encoder, state_dict)  copy the weights in, after checking every key
    load_safetensors(path)                a safetensors file as CPU tensors (never pickle)

Ours (``layers.{i}.attention.q_proj.weight``, ...) and Hugging Face's
(``encoder.layer.{i}.attention.self.query.weight``, ...) names, with or without
the ``bert.`` prefix of ``BertFor*`` checkpoints; ``pooler.*``, ``cls.*`` and
``embeddings.position_ids`` are ignored. BERT's separate query/key/value
weights fuse into the attention's ``qkv_proj`` in its own load hook. The map
lives with the models (``models.minilm`` loads through it); models never
import a converter.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

__all__ = ["hf_name_map", "load_hf_weights", "load_safetensors"]

_IGNORED_PREFIXES = ("pooler.", "cls.")
_IGNORED_KEYS = ("embeddings.position_ids",)
_EMBEDDING_NAMES = {
    "embeddings.word_embeddings.weight": "embeddings.word_embeddings.weight",
    "embeddings.position_embeddings.weight": "embeddings.position_embeddings.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type_embeddings.weight",
    "embeddings.norm.weight": "embeddings.LayerNorm.weight",
    "embeddings.norm.bias": "embeddings.LayerNorm.bias",
}
_LAYER_NAMES = {  # ours (under layers.{i}.) -> HF (under encoder.layer.{i}.), for .weight and .bias
    "attention.q_proj": "attention.self.query",
    "attention.k_proj": "attention.self.key",
    "attention.v_proj": "attention.self.value",
    "attention.out_proj": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "intermediate": "intermediate.dense",
    "output": "output.dense",
    "output_norm": "output.LayerNorm",
}


def _strip_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop a leading ``bert.`` (BertFor* checkpoints) when the keys carry it."""
    if any(k.startswith("bert.") for k in state_dict) and not any(k.startswith("embeddings.") for k in state_dict):
        return {(k[5:] if k.startswith("bert.") else k): v for k, v in state_dict.items()}
    return dict(state_dict)


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Read a safetensors file into a dict of CPU tensors (never pickle).

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is not a readable safetensors file (truncated,
            corrupt header, ...); the message names the file.
    """
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path}")
    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # SafetensorError, OSError, ... from deep inside
        raise ValueError(
            f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc}); "
            "the file may be truncated or corrupt"
        ) from None


def hf_name_map(encoder: nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A ``BertEncoder``'s split-layout state-dict name -> (Hugging Face name, expected shape).

    Raises:
        ValueError: an attention kind without the q/k/v/out projections BERT's weights fill.
    """
    params = dict(encoder.named_parameters())
    out = {ours: (hf, tuple(params[ours].shape)) for ours, hf in _EMBEDDING_NAMES.items()}
    for i, layer in enumerate(encoder.layers):
        qkv = layer.attention.projection_weights() if hasattr(layer.attention, "projection_weights") else {}
        for ours, hf in _LAYER_NAMES.items():
            for suffix in ("weight", "bias"):
                name = f"layers.{i}.{ours}.{suffix}"
                letter = ours[len("attention.")] if ours.endswith(("q_proj", "k_proj", "v_proj")) else None
                if letter is not None and qkv:
                    tensor = qkv[letter][0 if suffix == "weight" else 1]
                elif name in params:
                    tensor = params[name]
                else:
                    raise ValueError(
                        f"attention kind {encoder.config.attention!r} has no parameter {name}; "
                        "it cannot load Hugging Face BERT weights"
                    )
                out[name] = (f"encoder.layer.{i}.{hf}.{suffix}", tuple(tensor.shape))
    return out


def load_hf_weights(encoder: nn.Module, state_dict: Mapping[str, torch.Tensor], *, source: str = "state dict") -> None:
    """``encoder.load_hf_state_dict(state_dict, source=source)`` (``BertEncoder``): its
    docstring says what is checked.

    Raises:
        TypeError: not a mapping of str to tensors.
        ValueError: missing keys, unexpected keys or wrong shapes (all listed).
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"state_dict must be a mapping of names to tensors, got {type(state_dict).__name__}")
    bad = [k for k, v in state_dict.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"{source}: state_dict entries must map str to torch.Tensor; bad keys {bad[:5]}")
    sd = _strip_prefix(state_dict)
    sd = {k: v for k, v in sd.items() if not k.startswith(_IGNORED_PREFIXES) and k not in _IGNORED_KEYS}
    names = hf_name_map(encoder)
    used = {hf for hf, _ in names.values()}
    missing = sorted(hf for hf in used if hf not in sd)
    unexpected = sorted(k for k in sd if k not in used)
    wrong = [
        f"{hf}: expected {shape}, got {tuple(sd[hf].shape)}"
        for hf, shape in names.values()
        if hf in sd and tuple(sd[hf].shape) != shape
    ]
    wrong += [f"{k}: dtype {v.dtype} is not floating" for k, v in sd.items() if k in used and not v.is_floating_point()]
    problems = []
    if missing:
        problems.append(f"missing keys ({len(missing)}): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected keys ({len(unexpected)}): {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    if wrong:
        problems.append(f"wrong shapes/dtypes ({len(wrong)}): {wrong[:8]}{' ...' if len(wrong) > 8 else ''}")
    if problems:
        raise ValueError(f"{source} does not match BertConfig {encoder.config}: " + "; ".join(problems))
    ours = {name: sd[hf] for name, (hf, _) in names.items()}  # q/k/v fuse in the attention's load hook
    with torch.no_grad():
        encoder.load_state_dict(ours, strict=True)
