"""Save and load a ``GPT`` (config and weights in one safetensors file, never
pickle).

Two layouts, chosen by the path::

    run/                         a directory (created if needed)
      model.safetensors          THE checkpoint: the state dict (the tied LM head
                                 stored once), with the config and checksums in its header
      config.json                {"format": "multihead.gpt", "version": 1, "config": {...}}, a copy

    tiny.safetensors             a pair of files side by side
    tiny.json

The safetensors file is the whole checkpoint; its ``__metadata__`` holds::

    format   "multihead.gpt"
    config   the GPTConfig as JSON
    sha256   {"config": <hex digest of that JSON text>, "tensors": {name: <hex digest of the tensor's bytes>}}

Saving replaces that one file as a whole (``multihead.io.write_atomic``: a
staging directory, fsync, ``os.replace``), so config and weights change
together: a kill -9 at any moment leaves the old checkpoint or the new one,
never new weights with an old config. The JSON file is written afterwards for
people and tools that look for a ``config.json``; ``load_checkpoint`` and
``read_config`` use the config in the header, so a JSON file left stale by a
crash between the two writes (or edited by hand) changes nothing. Weights
without a config in their header (written by other tools) are read with
their JSON file. Files of earlier versions (config in the header, no
checksums) load as before, without the checksum check. A killed save leaves
at most a ``.<name>.<pid>.<hex>.tmp`` staging directory, removed by the next
save to the same path.

Loading trusts nothing in the files, and checks before allocating anything
large, in this order:

    header     length, JSON, dtypes, shapes and byte ranges (``multihead.io``)
    config     size (1 MiB), JSON nesting, an object at the top, valid fields, its checksum
    dtypes     every tensor floating point (no integer or bool weights)
    sizes      embeddings and layer count against the config, then every name
               and shape against a GPT built on the meta device (no memory)
    bytes      every tensor against its sha256 (when the file has checksums)

and only then builds the model and copies the tensors in. Each refusal is one
ValueError naming the file and the problem. Hugging Face GPT-2 weights are
converted by ``multihead.convert.hf_gpt2``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..io import (
    FLOAT_DTYPES,
    SafetensorsHeader,
    parse_json_object,
    read_json_file,
    read_safetensors_header,
    read_tensors,
    save_safetensors,
    tensor_sha256,
    write_text_atomic,
)
from .gpt import GPT, GPTConfig
from .quantize import refuse_weight_only
from .run_dirs import checkpoint_path

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "read_config",
    "checkpoint_paths",
    "check_state_shapes",
]

FORMAT = "multihead.gpt"
VERSION = 1  # of the JSON file's layout
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_HEX64 = re.compile(r"[0-9a-f]{64}")


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


def save_checkpoint(
    model: GPT, path: str | os.PathLike, *, state_dict: dict[str, torch.Tensor] | None = None
) -> tuple[Path, Path]:
    """Write ``model``'s config and weights (replacing a checkpoint already there as a whole).

    Args:
        model: a ``GPT``.
        path: a directory, or ``name.safetensors`` for a pair of files.
        state_dict: the weights to write (default ``model.state_dict()``): the
            full state dict of a model whose parameters are sharded.

    Returns:
        (config path, weights path).

    Raises:
        TypeError: ``model`` is not a GPT.
        ValueError: a model with weight-only bf16/int8 layers (``models.quantize``).
    """
    if not isinstance(model, GPT):
        raise TypeError(f"save_checkpoint takes a GPT, got {type(model).__name__}")
    refuse_weight_only(model, "save")
    config_path, weights_path = checkpoint_paths(path)
    weights_path.parent.mkdir(parents=True, exist_ok=True)
    config_text = json.dumps(model.config.to_dict(), sort_keys=True)
    state = dict(model.state_dict() if state_dict is None else state_dict)
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")  # the same tensor as token_embedding.weight
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    checksums = {
        "config": hashlib.sha256(config_text.encode("utf-8")).hexdigest(),
        "tensors": {k: tensor_sha256(v) for k, v in tensors.items()},
    }
    metadata = {"format": FORMAT, "config": config_text, "sha256": json.dumps(checksums, sort_keys=True)}
    save_safetensors(tensors, weights_path, metadata)  # the checkpoint, in one rename
    document = {"format": FORMAT, "version": VERSION, "config": model.config.to_dict()}
    write_text_atomic(config_path, json.dumps(document, indent=2) + "\n")  # the copy
    return config_path, weights_path


def _config_from_dict(values: object, source: str) -> GPTConfig:
    try:
        return GPTConfig.from_dict(values)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: invalid config: {e}") from None


def _json_config(config_path: Path) -> GPTConfig:
    """The config of a checkpoint's JSON file (weights without a config in their header)."""
    data = read_json_file(config_path, MAX_CONFIG_BYTES)
    if data.get("format") != FORMAT or "config" not in data:
        raise ValueError(
            f"{config_path} is not a multihead GPT checkpoint config "
            f"(expected {{'format': {FORMAT!r}, 'version': {VERSION}, 'config': {{...}}}})"
        )
    if data.get("version") != VERSION:
        raise ValueError(f"{config_path} has checkpoint version {data.get('version')!r}; this reader knows {VERSION}")
    return _config_from_dict(data["config"], str(config_path))


def _few(names: list[str]) -> str:
    return ", ".join(map(repr, names[:8])) + (f" and {len(names) - 8} more" if len(names) > 8 else "")


def _header_config(header: SafetensorsHeader) -> tuple[GPTConfig, dict[str, str] | None] | None:
    """(config, tensor checksums or None) from a weights header; None when it has no config."""
    meta, source = header.metadata, header.path
    if meta.get("format") != FORMAT or "config" not in meta:
        return None
    text = meta["config"]
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"{source}: the config in its header is {len(text)} characters (at most {MAX_CONFIG_BYTES})")
    tensor_sums = None
    if "sha256" in meta:
        sums = parse_json_object(meta["sha256"], f"{source}: the sha256 entry of its header")
        tensor_sums = sums.get("tensors")
        if (
            not isinstance(sums.get("config"), str)
            or not isinstance(tensor_sums, dict)
            or not all(isinstance(h, str) and _HEX64.fullmatch(h) for h in [sums["config"], *tensor_sums.values()])
        ):
            raise ValueError(
                f"{source}: the sha256 entry of its header does not list one hex digest for the config "
                "and for each tensor of the file"
            )
        missing = sorted(set(tensor_sums) - set(header.tensors))
        extra = sorted(set(header.tensors) - set(tensor_sums))
        if missing:
            raise ValueError(
                f"{source} is missing tensor(s) {_few(missing)} that were written with it (the checksums in its "
                "header list them): the file was changed after it was saved"
            )
        if extra:
            raise ValueError(
                f"{source}: the sha256 entry of its header does not list tensor(s) {_few(extra)} of the file "
                "(it lists one hex digest for the config and for each tensor written)"
            )
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != sums["config"]:
            raise ValueError(f"{source} is corrupt: its config does not match the sha256 checksum stored with it")
    values = parse_json_object(text, f"{source}: the config in its header")
    return _config_from_dict(values, f"{source} (config in its header)"), tensor_sums


def read_config(path: str | os.PathLike) -> GPTConfig:
    """The ``GPTConfig`` of the checkpoint at ``path`` (directory, .json or .safetensors,
    or a ``multihead train`` run directory: its latest checkpoint).

    The config in the weights' header when there is one, else the JSON file's.

    Raises:
        FileNotFoundError: neither a config in the weights nor a config file.
        ValueError: a corrupt or hostile file, not a multihead GPT config, or invalid fields.
    """
    config_path, weights_path = checkpoint_paths(checkpoint_path(path))
    if weights_path.is_file():
        with open(weights_path, "rb") as f:
            found = _header_config(read_safetensors_header(f, weights_path))
        if found is not None:
            return found[0]
    if not config_path.is_file():
        raise FileNotFoundError(f"no checkpoint config at {config_path} (nor in weights at {weights_path})")
    return _json_config(config_path)


class _SkipFills(TorchFunctionMode):
    """Skip the value fills of module construction (torch.nn.init, Tensor.normal_,
    ...). On the meta device they compute nothing anyway, but the first random
    fill on meta imports much of torch (about 2 s); only shapes are wanted here."""

    FILLS = frozenset({"normal_", "uniform_", "fill_", "zero_", "copy_", "bernoulli_", "random_", "exponential_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init" or getattr(func, "__name__", None) in self.FILLS:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.device.type == "meta":
                return target  # in place, shape unchanged
        return func(*args, **kwargs)


def _check_fits(config: GPTConfig, header: SafetensorsHeader) -> torch.dtype:
    """Refuse tensors that are not the weights ``config`` implies, reading only
    the header and a GPT on the meta device; return the embedding's dtype."""
    source, entries = header.path, header.tensors
    not_float = [f"{k} ({e.dtype})" for k, e in entries.items() if e.dtype not in FLOAT_DTYPES]
    if not_float:
        raise ValueError(
            f"{source} holds non-floating-point tensors where floating-point weights (F16, BF16, F32, F64) belong: "
            f"{not_float[:8]}{' ...' if len(not_float) > 8 else ''}"
        )
    if "token_embedding.weight" not in entries:
        raise ValueError(f"{source} has no 'token_embedding.weight'; it is not a GPT checkpoint")
    # Sizes read straight off the config first, so a hostile one (context_length=2**40,
    # num_layers=10**9) is refused before even a meta model is built for it.
    C = config.embed_dim
    direct = {
        "token_embedding.weight": (config.vocab_size, C),
        "position_embedding.weight": (config.context_length, C),
    }
    bad = [
        f"{k}: {entries[k].shape} in the file vs {shape} from the config"
        for k, shape in direct.items()
        if k in entries and entries[k].shape != shape
    ]
    if bad:
        raise ValueError(f"{source} has tensors of the wrong shape for its config: " + "; ".join(bad))
    layers = sorted({int(k.split(".")[1]) for k in entries if re.fullmatch(r"blocks\.\d+\..+", k)})
    if len(layers) != config.num_layers or layers != list(range(len(layers))):
        held = f"blocks {layers[:4]}{' ...' if len(layers) > 4 else ''} ({len(layers)} in all)" if layers else "none"
        raise ValueError(f"{source} does not match its config: num_layers={config.num_layers}, the file holds {held}")
    dtype = FLOAT_DTYPES[entries["token_embedding.weight"].dtype]
    try:
        with torch.device("meta"), _SkipFills():
            expected = GPT(config, device="meta", dtype=dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: a GPT cannot be built from its config: {e}") from None
    check_state_shapes(expected, {k: e.shape for k, e in entries.items()}, source)
    return dtype


def load_checkpoint(
    path: str | os.PathLike,
    *,
    config: GPTConfig | None = None,
    device: torch.device | str | None = None,
) -> GPT:
    """Rebuild the ``GPT`` saved at ``path``.

    Args:
        path: a directory, or the ``.safetensors`` / ``.json`` of a pair, or
            the run directory of ``multihead train`` (holding
            ``checkpoints/``): the checkpoint its ``checkpoints/latest``
            names (``models.run_dirs``), as ``--checkpoint RUN`` reads it.
        config: when given, the stored config must equal it.
        device: where to put the model (default CPU).

    Returns:
        the model (in training mode, like a fresh module; call ``.eval()``).

    Raises:
        FileNotFoundError: a missing file, a run directory with no complete
            checkpoint yet.
        ValueError: a broken ``checkpoints/latest`` pointer, a corrupt or hostile file (header, JSON, checksums), integer
            or bool tensors, tensors that do not match the config (names or
            shapes), or a stored config different from ``config``; raised
            before the model is built.
    """
    config_path, weights_path = checkpoint_paths(checkpoint_path(path))
    if not weights_path.is_file():
        if not config_path.is_file():
            raise FileNotFoundError(f"no checkpoint config at {config_path} and no weights at {weights_path}")
        raise FileNotFoundError(f"no checkpoint weights at {weights_path}")
    # One open file for the header and the bytes: a checkpoint saved over this
    # one meanwhile (a rename) cannot mix into what is read.
    with open(weights_path, "rb") as f:
        header = read_safetensors_header(f, weights_path)
        found = _header_config(header)
        if found is None:
            if not config_path.is_file():
                raise FileNotFoundError(f"no checkpoint config at {config_path} (nor in the header of {weights_path})")
            stored, checksums = _json_config(config_path), None
        else:
            stored, checksums = found
        if config is not None and config != stored:
            want, got = config.to_dict(), stored.to_dict()
            names = [*want, *(k for k in got if k not in want)]  # a field may be left out on one side
            diff = {k: (got.get(k), want.get(k)) for k in names if want.get(k) != got.get(k)}
            raise ValueError(
                f"{weights_path}: the checkpoint config differs from the expected config: "
                f"{{field: (stored, expected)}} = {diff}"
            )
        dtype = _check_fits(stored, header)
        tensors = read_tensors(f, header, checksums)
    # Built for real (not on the meta device) so buffers that attention kinds
    # compute at construction exist; then the file's tensors are copied in.
    model = GPT(stored, dtype=dtype)
    model.load_state_dict(tensors, strict=False)
    return model.to(device) if device is not None else model


def check_state_shapes(model: nn.Module, shapes: Mapping[str, Sequence[int]], source: str) -> None:
    """Refuse weights that are not exactly ``model``'s, by name and shape.

    Args:
        model: the module they are for (a GPT's tied ``lm_head.weight`` may be absent).
        shapes: name -> shape of the weights.
        source: what holds them, for the message.

    Raises:
        ValueError: missing or unexpected names, or shapes that differ.
    """
    expected = dict(model.state_dict())
    tied = getattr(getattr(model, "config", None), "tie_embeddings", False)
    if tied:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{source} does not match the model: missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    bad = [
        f"{k}: {tuple(shapes[k])} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if tuple(shapes[k]) != tuple(v.shape)
    ]
    if bad:
        raise ValueError(f"{source} has tensors of the wrong shape for the model config: " + "; ".join(bad[:8]))
