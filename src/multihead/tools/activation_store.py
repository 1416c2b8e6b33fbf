"""Where ``run_with_cache`` keeps what it records, for multihead's layers and
the Hugging Face bridge alike: ``Store`` clones exactly the tensors asked
for (a layer's q/k/v and per-head tensors cut to the heads asked for) and
refuses a layer that runs twice in one forward.
"""

from __future__ import annotations

import torch

from ..functional import WeightSelection
from .activations import Activations

__all__ = ["Store", "check_heads", "output_of", "input_of"]


class Store:
    """The tensors of one run, each clone of exactly what was asked for."""

    def __init__(self, names: tuple[str, ...], heads: tuple[int, ...] | None) -> None:
        self.names, self.heads = names, heads
        self.tensors: dict[str, torch.Tensor] = {}
        self.kv_heads: dict[int, tuple[int, ...]] = {}

    def put(self, layer: int, name: str, tensor: torch.Tensor, where: str) -> None:
        """Keep ``tensor`` as "layers.{layer}.{name}" if ``name`` was asked for.

        Raises:
            ValueError: the layer already gave this name in this run (it ran twice).
        """
        if name not in self.names:
            return
        key = f"layers.{layer}.{name}"
        if key in self.tensors:
            raise ValueError(
                f"layer {layer} ({where}) ran twice in one forward: run_with_cache keeps one call per layer "
                "(run a generation loop step by step)"
            )
        self.tensors[key] = tensor.detach().clone()

    def put_qkv(self, layer: int, where: str, q, k, v, H: int, *, pre: bool = False) -> None:
        """q [B, H', T, D], k [B, G, S, D], v [B, G, S, Dv] of a layer with H query heads,
        cut to the heads asked for (k and v: the key/value heads those read);
        ``pre``: q and k before qk_norm and rope, kept as q_pre and k_pre (v unused)."""
        names = ("q_pre", "k_pre", "") if pre else ("q", "k", "v")
        if self.heads is not None and (set(names) & set(self.names)):
            if q.shape[1] != H or (v is not None and v.shape[1] != k.shape[1]):
                held = f"{q.shape[1]} q heads" + ("" if v is None else f", {k.shape[1]} k heads, {v.shape[1]} v heads")
                raise ValueError(
                    f"heads={list(self.heads)}: layer {layer} ({where}) has {held} for its {H} query heads, so "
                    f"{'/'.join(n for n in names if n)} cannot be cut by head: ask for them without heads="
                )
            G = k.shape[1]
            kv = tuple(sorted({h // (H // G) for h in self.heads}))
            self.kv_heads[layer] = kv
            q, k = q[:, list(self.heads)], k[:, list(kv)]  # (B, H, T, D) -> (B, h, T, D); (B, G, S, D) -> (B, g, S, D)
            v = None if v is None else v[:, list(kv)]  # (B, G, S, Dv) -> (B, g, S, Dv)
        if v is None and "v" in self.names and not pre:
            raise ValueError(f"layer {layer} ({where}) hands its observers no values, so 'v' cannot be recorded")
        for name, t in zip(names, (q, k, v)):
            if name and t is not None:
                self.put(layer, name, t, where)

    def put_heads(self, layer: int, name: str, t: torch.Tensor, where: str) -> None:
        """A [B, H, ...] tensor cut to the query heads asked for."""
        if name in self.names:
            self.put(layer, name, t if self.heads is None else t[:, list(self.heads)], where)

    def record(self, layers: list[int], source: str) -> Activations:
        return Activations(dict(self.tensors), self.names, tuple(layers), self.heads, dict(self.kv_heads), source)


def check_heads(heads: object) -> tuple[int, ...] | None:
    """``heads`` as ascending ints (None: all); TypeError / ValueError otherwise."""
    return None if heads is None else WeightSelection(heads=heads).heads


def output_of(output) -> torch.Tensor:
    """A module's output tensor: the output itself, or the first entry of a tuple."""
    return output[0] if isinstance(output, (tuple, list)) else output


def input_of(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A block's input hidden states: its first positional argument, else ``hidden_states=``."""
    x = args[0] if args else kwargs.get("hidden_states", kwargs.get("x"))
    return x if isinstance(x, torch.Tensor) else None
