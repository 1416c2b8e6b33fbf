"""Save and load a ``GPT`` (config as JSON, weights as safetensors, never
pickle), and convert Hugging Face GPT-2 state dicts to and from ours.

Two layouts, chosen by the path::

    run/                         a directory (created if needed)
      config.json                {"format": "multihead.gpt", "version": 1, "config": {...}}
      model.safetensors          the state dict (the tied LM head stored once)

    tiny.safetensors             a pair of files side by side
    tiny.json

Each file is written to a temporary name in the same directory, then moved
into place with ``os.replace``, so a reader never sees a half-written file.
The safetensors header repeats the config, so a JSON file paired with the
wrong weights is caught on load.

Hugging Face GPT-2 names map onto ours (``GPT.from_hf_state_dict`` /
``GPT.to_hf_state_dict`` call the functions here)::

    transformer.wte / wpe              token_embedding / position_embedding
    transformer.h.{i}.ln_1, ln_2       blocks.{i}.ln_1, ln_2
    transformer.h.{i}.attn.c_attn      blocks.{i}.attn.qkv_proj   (Conv1D (C, 3C) = Linear weight transposed)
    transformer.h.{i}.attn.c_proj      blocks.{i}.attn.out_proj   (transposed)
    transformer.h.{i}.mlp.c_fc, c_proj blocks.{i}.mlp.fc, proj    (transposed)
    transformer.ln_f, lm_head          ln_f, lm_head (tied to the token embedding)
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .gpt import GPT, GPTConfig, _require_gpt2_layout

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "read_config",
    "checkpoint_paths",
    "gpt_from_hf_state_dict",
    "gpt_to_hf_state_dict",
]

FORMAT = "multihead.gpt"
VERSION = 1
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def checkpoint_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """(config JSON path, weights path) for a checkpoint at ``path``.

    ``x.safetensors`` or ``x.json`` name a pair of files (``x.json`` +
    ``x.safetensors``); anything else names a directory holding
    ``config.json`` and ``model.safetensors``.
    """
    p = Path(path)
    if p.suffix in (".safetensors", ".json"):
        return p.with_suffix(".json"), p.with_suffix(".safetensors")
    return p / CONFIG_NAME, p / WEIGHTS_NAME


def _atomic_write(target: Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_name)`` on a temp file beside ``target``, then os.replace it."""
    # A unique name in the target's directory (so os.replace is a rename on one
    # file system), created by ``write`` itself so it gets the usual permissions.
    tmp = str(target.with_name(f".{target.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"))
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_checkpoint(model: GPT, path: str | os.PathLike) -> tuple[Path, Path]:
    """Write ``model``'s config and weights.

    Args:
        model: a ``GPT``.
        path: a directory, or ``name.safetensors`` for a pair of files.

    Returns:
        (config path, weights path).

    Raises:
        TypeError: ``model`` is not a GPT.
    """
    from safetensors.torch import save_file

    if not isinstance(model, GPT):
        raise TypeError(f"save_checkpoint takes a GPT, got {type(model).__name__}")
    config_path, weights_path = checkpoint_paths(path)
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_json = json.dumps({"format": FORMAT, "version": VERSION, "config": model.config.to_dict()}, indent=2)
    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")  # the same tensor as token_embedding.weight
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    metadata = {"format": FORMAT, "config": json.dumps(model.config.to_dict(), sort_keys=True)}
    _atomic_write(weights_path, lambda tmp: save_file(tensors, tmp, metadata=metadata))

    def write_json(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(config_json + "\n")

    _atomic_write(config_path, write_json)
    return config_path, weights_path


def read_config(path: str | os.PathLike) -> GPTConfig:
    """The ``GPTConfig`` of the checkpoint at ``path`` (directory, .json or .safetensors).

    Raises:
        FileNotFoundError: no config file.
        ValueError: not valid JSON, not a multihead GPT config, or invalid fields.
    """
    config_path, _ = checkpoint_paths(path)
    if not config_path.is_file():
        raise FileNotFoundError(f"no checkpoint config at {config_path}")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{config_path} is not valid JSON ({e}); the checkpoint config is corrupt") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT or "config" not in data:
        raise ValueError(
            f"{config_path} is not a multihead GPT checkpoint config "
            f"(expected {{'format': {FORMAT!r}, 'version': {VERSION}, 'config': {{...}}}})"
        )
    if data.get("version") != VERSION:
        raise ValueError(f"{config_path} has checkpoint version {data.get('version')!r}; this reader knows {VERSION}")
    try:
        return GPTConfig.from_dict(data["config"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_path}: invalid config: {e}") from e


def _read_weights(weights_path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open

    if not weights_path.is_file():
        raise FileNotFoundError(f"no checkpoint weights at {weights_path}")
    try:
        with safe_open(str(weights_path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except Exception as e:  # safetensors raises its own error types for bad headers/sizes
        raise ValueError(f"{weights_path} is not a readable safetensors file (corrupt or truncated?): {e}") from e
    return tensors, metadata


def load_checkpoint(
    path: str | os.PathLike,
    *,
    config: GPTConfig | None = None,
    device: torch.device | str | None = None,
) -> GPT:
    """Rebuild the ``GPT`` saved at ``path``.

    Args:
        path: a directory, or the ``.safetensors`` / ``.json`` of a pair.
        config: when given, the stored config must equal it.
        device: where to put the model (default CPU).

    Returns:
        the model (in training mode, like a fresh module; call ``.eval()``).

    Raises:
        FileNotFoundError: a missing file.
        ValueError: a corrupt file, weights that do not match the config
            (names or shapes), or a stored config different from ``config``.
    """
    stored = read_config(path)
    if config is not None and config != stored:
        want, got = config.to_dict(), stored.to_dict()
        diff = {k: (got[k], want[k]) for k in want if want[k] != got[k]}
        raise ValueError(f"checkpoint config differs from the expected config: {{field: (stored, expected)}} = {diff}")
    _, weights_path = checkpoint_paths(path)
    tensors, metadata = _read_weights(weights_path)
    if "config" in metadata:
        try:
            header_config = json.loads(metadata["config"])
        except json.JSONDecodeError as e:
            raise ValueError(f"{weights_path} has a corrupt config in its header: {e}") from e
        if header_config != stored.to_dict():
            diff = {
                k: (stored.to_dict().get(k), header_config.get(k))
                for k in set(header_config) | set(stored.to_dict())
                if stored.to_dict().get(k) != header_config.get(k)
            }
            raise ValueError(
                f"{weights_path} was saved with a different config than {checkpoint_paths(path)[0]}: "
                f"{{field: (json, weights)}} = {diff}"
            )
    if "token_embedding.weight" not in tensors:
        raise ValueError(f"{weights_path} has no 'token_embedding.weight'; it is not a GPT checkpoint")
    # Built for real (not on the meta device) so buffers that attention kinds
    # compute at construction exist; then the file's tensors are copied in.
    model = GPT(stored, dtype=tensors["token_embedding.weight"].dtype)
    _check_keys_and_shapes(model, tensors, str(weights_path))
    model.load_state_dict(tensors, strict=False)
    return model.to(device) if device is not None else model


# ------------------------------------------------------------- Hugging Face GPT-2
def gpt_from_hf_state_dict(
    state_dict: dict[str, torch.Tensor], config: GPTConfig | None = None, *, cls: type[GPT] = GPT
) -> GPT:
    """See :meth:`GPT.from_hf_state_dict` (``cls`` builds the model)."""
    sd = dict(state_dict)
    if not any(k.startswith("transformer.") for k in sd):
        sd = {f"transformer.{k}": v for k, v in sd.items()}
    for key in ("transformer.wte.weight", "transformer.wpe.weight"):
        if key not in sd:
            raise ValueError(f"not a GPT-2 state dict: {key!r} is missing")
    if config is None:
        V, C = sd["transformer.wte.weight"].shape
        layers = {int(k.split(".")[2]) for k in sd if k.startswith("transformer.h.")}
        if C % 64 != 0:
            raise ValueError(f"cannot infer num_heads for embed_dim={C} (not a multiple of 64); pass config")
        config = GPTConfig(
            vocab_size=V,
            context_length=sd["transformer.wpe.weight"].shape[0],
            embed_dim=C,
            num_layers=max(layers) + 1 if layers else 0,
            num_heads=C // 64,
            tie_embeddings="lm_head.weight" not in sd
            or torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"]),
        )
    _require_gpt2_layout(config)
    ours = {}
    for key, value in sd.items():
        name = _hf_to_ours(key)
        if name is None:
            continue  # causal-mask buffers of older transformers versions
        if name == "lm_head.weight" and config.tie_embeddings:
            if not torch.equal(value, sd["transformer.wte.weight"]):
                raise ValueError(
                    "lm_head.weight differs from transformer.wte.weight: the checkpoint is untied; "
                    "pass a config with tie_embeddings=False"
                )
            continue
        transpose = key.endswith(".weight") and any(f".{p}." in key for p in _CONV1D)
        ours[name] = value.detach().t() if transpose else value.detach()
    dtype = sd["transformer.wte.weight"].dtype
    model = cls(config, device="meta", dtype=dtype)
    _check_keys_and_shapes(model, ours, "Hugging Face GPT-2 state dict")
    model.load_state_dict({k: v.contiguous().clone() for k, v in ours.items()}, strict=False, assign=True)
    if config.tie_embeddings:
        model.lm_head.weight = model.token_embedding.weight
    return model


def gpt_to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """See :meth:`GPT.to_hf_state_dict`."""
    _require_gpt2_layout(model.config)
    out = {}
    for name, value in model.state_dict().items():
        key = _ours_to_hf(name)
        transpose = key.endswith(".weight") and any(f".{p}." in key for p in _CONV1D)
        out[key] = (value.t() if transpose else value).detach().contiguous().clone()
    if "lm_head.weight" not in out:
        out["lm_head.weight"] = out["transformer.wte.weight"]
    return out


# ------------------------------------------------------------- name mapping
_CONV1D = ("c_attn", "c_proj", "c_fc")
_TOP = {
    "transformer.wte.weight": "token_embedding.weight",
    "transformer.wpe.weight": "position_embedding.weight",
    "transformer.ln_f.weight": "ln_f.weight",
    "transformer.ln_f.bias": "ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}
_BLOCK = {
    "ln_1": "ln_1",
    "attn.c_attn": "attn.qkv_proj",
    "attn.c_proj": "attn.out_proj",
    "ln_2": "ln_2",
    "mlp.c_fc": "mlp.fc",
    "mlp.c_proj": "mlp.proj",
}


def _hf_to_ours(key: str) -> str | None:
    """HF key -> our key; None for buffers to skip; the HF key itself when unknown
    (so the key check reports it as unexpected)."""
    if key in _TOP:
        return _TOP[key]
    parts = key.split(".")
    if len(parts) >= 5 and parts[:2] == ["transformer", "h"]:
        sub, leaf = ".".join(parts[3:-1]), parts[-1]
        if sub == "attn" and leaf in ("bias", "masked_bias"):
            return None
        if sub in _BLOCK:
            return f"blocks.{parts[2]}.{_BLOCK[sub]}.{leaf}"
    return key


def _ours_to_hf(name: str) -> str:
    for hf, ours in _TOP.items():
        if name == ours:
            return hf
    _, i, rest = name.split(".", 2)
    sub, leaf = rest.rsplit(".", 1)
    hf_sub = {v: k for k, v in _BLOCK.items()}[sub]
    return f"transformer.h.{i}.{hf_sub}.{leaf}"


def _check_keys_and_shapes(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError unless ``tensors`` holds exactly the model's weights
    (the tied LM head may be absent) with the model's shapes."""
    expected = dict(model.state_dict())
    tied = getattr(model, "config", None) is not None and model.config.tie_embeddings
    if tied:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    bad = [
        f"{k}: {tuple(tensors[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if tuple(tensors[k].shape) != tuple(v.shape)
    ]
    if bad:
        raise ValueError(f"{source} has tensors of the wrong shape for the model config: " + "; ".join(bad[:8]))
