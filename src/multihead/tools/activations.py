"""Named activations of one forward: the record ``run_with_cache`` returns.

    out, acts = run_with_cache(model, input_ids, names=("q", "pattern", "z"))
    acts["layers.3.q"]          # [B, H, T, D]
    acts.layer(3).q             # the same tensor
    acts.names, acts.layers     # what was asked for: ("q", "pattern", "z"), (0, 1, ...)
    acts.save("acts.safetensors"); Activations.load("acts.safetensors")

Names, with the shapes each layer's tensor has (B batch, T queries, S keys,
H query heads, G key/value heads, D / Dv head widths, C model width):

    q           [B, H, T, D]   queries after projection, qk_norm and rope: the ones scored
    k           [B, G, S, D]   keys, likewise (S counts cached keys too)
    q_pre       [B, H, T, D]   queries before qk_norm and rope (multihead's own layers only)
    k_pre       [B, G, T, D]   this call's keys before qk_norm and rope (likewise)
    v           [B, G, S, Dv]  values after projection
    pattern     [B, H, T, S]   the weights that mix the values (``tools.capture``'s weights)
    z           [B, H, T, Dv]  each head's output (weights times values), before the output projection
    attn_out    [B, T, C]      the attention module's output (after its output projection)
    resid_pre   [B, T, C]      the residual stream entering the layer's block
    resid_post  [B, T, C]      the residual stream leaving it

Keys and values stay at G heads (GQA/MQA; query head h reads key/value head
h // (H // G)). With ``heads=`` only those query heads are kept in q,
pattern and z, and in k and v only the key/value heads they read
(``kv_heads[layer]``). A kind whose q has more heads than its weights
(differential attention's 2H sub-heads), or whose keys and values differ in
head count (collaborative attention), keeps its own q/k/v layout and
refuses ``heads=`` for them. q_pre / k_pre are in the layout of the kind's
``to_heads``: the same as q and k for MHA/GQA/MQA, and equal to them where
neither qk_norm nor rope is on.

The record holds exactly the tensors asked for, detached, on the device
and in the dtype the model computed them (``to`` moves them). ``save``
writes one safetensors file whose header metadata holds the record's JSON
description (names, layers, heads, source), written to a temporary name
and renamed; ``load`` reads it back without pickle.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["ACTIVATION_NAMES", "Activations", "LayerActivations"]

ACTIVATION_NAMES: dict[str, str] = {
    "q": "[B, H, T, D] queries after projection, qk_norm and rope",
    "k": "[B, G, S, D] keys after projection, qk_norm and rope",
    "q_pre": "[B, H, T, D] queries before qk_norm and rope",
    "k_pre": "[B, G, T, D] this call's keys before qk_norm and rope",
    "v": "[B, G, S, Dv] values after projection",
    "pattern": "[B, H, T, S] weights that mix the values",
    "z": "[B, H, T, Dv] per-head outputs before the output projection",
    "attn_out": "[B, T, C] attention output after the output projection",
    "resid_pre": "[B, T, C] residual stream entering the block",
    "resid_post": "[B, T, C] residual stream leaving the block",
}
_FORMAT = "multihead.activations"


def check_names(names: object) -> tuple[str, ...]:
    """The asked-for names as a tuple (a single str is one name).

    Raises:
        TypeError: names not a str or a list of str.
        ValueError: an unknown or repeated name, or none (listing the valid names).
    """
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"names must be a list of str, got names={names!r}; valid names: {list(ACTIVATION_NAMES)}")
    unknown = [n for n in names if n not in ACTIVATION_NAMES]
    if unknown or not names or len(set(names)) != len(names):
        problem = f"unknown name(s) {unknown}" if unknown else ("no name" if not names else "a name given twice")
        raise ValueError(f"names={list(names)}: {problem}; valid names: {list(ACTIVATION_NAMES)}")
    return tuple(names)


@dataclass(frozen=True)
class LayerActivations:
    """One layer's tensors, read as attributes (``acts.layer(3).q``).

    Attributes:
        layer: the layer's index; tensors: name -> tensor; heads / kv_heads:
            the query and key/value heads held (None: all).
    """

    layer: int
    tensors: dict[str, torch.Tensor]
    heads: tuple[int, ...] | None = None
    kv_heads: tuple[int, ...] | None = None

    def __getattr__(self, name: str) -> torch.Tensor:
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        if name in ACTIVATION_NAMES:
            raise AttributeError(f"layer {self.__dict__.get('layer')} holds no {name!r}: it holds {list(tensors)}")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}; valid names: {list(ACTIVATION_NAMES)}")


@dataclass
class Activations:
    """The named activations of one forward.

    Attributes:
        tensors: "layers.{i}.{name}" -> tensor (shapes in the module docstring).
        names: the names asked for, in the order asked.
        layers: the layers asked for, ascending.
        heads: the query heads kept in q, pattern and z (None: all).
        kv_heads: layer -> the key/value heads kept in k and v (only with ``heads``).
        source: the model's class name.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    names: tuple[str, ...] = ()
    layers: tuple[int, ...] = ()
    heads: tuple[int, ...] | None = None
    kv_heads: dict[int, tuple[int, ...]] = field(default_factory=dict)
    source: str = ""

    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, key: str) -> torch.Tensor:
        """The tensor named "layers.{i}.{name}".

        Raises:
            KeyError: a key the record does not hold, saying which layers and names it does.
        """
        if key in self.tensors:
            return self.tensors[key]
        raise KeyError(
            f"{key!r} is not in this record: it holds layers.{{i}}.{{name}} for layers {list(self.layers)} and names "
            f"{list(self.names)}; valid names: {list(ACTIVATION_NAMES)}"
        )

    def layer(self, index: int) -> LayerActivations:
        """Layer ``index``'s tensors as attributes.

        Raises:
            KeyError: a layer that was not recorded (listing those that were).
        """
        if isinstance(index, bool) or not isinstance(index, int) or index not in self.layers:
            raise KeyError(f"layer {index!r} was not recorded: this record holds layers {list(self.layers)}")
        prefix = f"layers.{index}."
        held = {k[len(prefix) :]: t for k, t in self.tensors.items() if k.startswith(prefix)}
        return LayerActivations(index, held, self.heads, self.kv_heads.get(index))

    def _with(self, tensors: dict[str, torch.Tensor]) -> Activations:
        return Activations(tensors, self.names, self.layers, self.heads, dict(self.kv_heads), self.source)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Activations:
        """A record with every tensor moved to ``device`` and/or cast to ``dtype``."""
        return self._with({k: t.to(device=device, dtype=dtype) for k, t in self.tensors.items()})

    def detach(self) -> Activations:
        """A record with every tensor detached (they already are when ``run_with_cache`` made them)."""
        return self._with({k: t.detach() for k, t in self.tensors.items()})

    def metadata(self) -> dict:
        """The JSON-ready description ``save`` stores beside the tensors."""
        return {
            "format": _FORMAT,
            "names": list(self.names),
            "layers": list(self.layers),
            "heads": None if self.heads is None else list(self.heads),
            "kv_heads": {str(i): list(h) for i, h in self.kv_heads.items()},
            "source": self.source,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write every tensor (on CPU, contiguous) to one safetensors file, the
        description as JSON in its header metadata, through ``multihead.io``
        (a temporary name, then renamed: a crash never leaves half a file)."""
        from ..io import save_safetensors

        tensors = {k: t.detach().to("cpu").contiguous() for k, t in self.tensors.items()}
        return save_safetensors(tensors, path, {_FORMAT: json.dumps(self.metadata())})

    @classmethod
    def load(cls, path: str | os.PathLike) -> Activations:
        """Read a file ``save`` wrote (CPU tensors).

        Raises:
            FileNotFoundError: no such file.
            ValueError: not a readable safetensors file, or one without this record's metadata.
        """
        from ..io import parse_json_object, read_safetensors_header, read_tensors

        with open(path, "rb") as f:
            header = read_safetensors_header(f, path)
            if _FORMAT not in header.metadata:
                raise ValueError(f"{path} holds no {_FORMAT} metadata: it was not written by Activations.save")
            meta = parse_json_object(header.metadata[_FORMAT], f"{path}'s {_FORMAT} metadata")
            tensors = read_tensors(f, header)
        try:
            heads = meta["heads"]
            return cls(
                tensors={k: tensors[k] for k in sorted(tensors, key=_key_order)},
                names=check_names(meta["names"]),
                layers=tuple(int(i) for i in meta["layers"]),
                heads=None if heads is None else tuple(int(h) for h in heads),
                kv_heads={int(i): tuple(int(h) for h in v) for i, v in meta["kv_heads"].items()},
                source=str(meta.get("source", "")),
            )
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"{path}: its {_FORMAT} metadata is not a record description ({e})") from None


def _key_order(key: str) -> tuple:
    """Layer, then name in ``ACTIVATION_NAMES`` order, for "layers.{i}.{name}"."""
    _, layer, name = (key.split(".", 2) + ["", ""])[:3]
    order = list(ACTIVATION_NAMES)
    return (int(layer) if layer.isdigit() else -1, order.index(name) if name in order else len(order), key)
