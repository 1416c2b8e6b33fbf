"""Where the kept heads of a pruned model stand among the heads it had.

A model pruned with ``tools.prune.prune_heads`` keeps ``layer_heads[i]`` of
its ``num_heads`` heads in layer i, renumbered 0..layer_heads[i]-1 in their
old order. The views (``tools.visualize``) draw every layer with
``num_heads`` slots so that the removed heads show as empty, "pruned" cells::

    num_heads = 4, layer 1 removed heads [0, 2] (prune's report.json)
    slot (head before pruning)   0        1     2        3
    layer 1                      pruned   H0    pruned   H1

    the same without the report: the removed slots go after the kept heads
    slot                         0        1     2        3
    layer 1                      H0       H1    pruned   pruned

``HeadSlots.layers[layer][slot]`` is the current index of the kept head
drawn in that slot, or None for a removed head. ``original`` says whether
the slot is the head's index before pruning (known from the report) or
only a position.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from .._checks import positive_int

__all__ = ["HeadSlots"]


@dataclass(frozen=True)
class HeadSlots:
    """The slots of each layer of a model whose layers kept fewer heads than ``num_heads``.

    Attributes:
        num_heads: slots per layer (the model's head count before pruning).
        layers: model layer number -> ``num_heads`` entries, each the current
            index of the kept head in that slot or None (a removed head).
        original: True when a slot's position is the head's index before
            pruning; False when the removed slots were only put after the kept ones.
    """

    num_heads: int
    layers: Mapping[int, tuple[int | None, ...]]
    original: bool

    @classmethod
    def from_counts(
        cls, num_heads: int, layer_heads: Sequence[int], removed: Mapping[int, Iterable[int]] | None = None
    ) -> HeadSlots:
        """Slots from per-layer head counts and, when known, the removed heads.

        Args:
            num_heads: heads per layer before pruning.
            layer_heads: heads each layer kept, [L].
            removed: layer -> the removed heads' indices before pruning (what
                ``prune_heads`` was given); None: unknown, the removed slots
                follow the kept heads.

        Raises:
            ValueError: a count outside 1..num_heads, or ``removed`` not
                matching the counts (wrong number of heads in a layer, an
                index out of range or repeated, a layer out of range).
        """
        num_heads = positive_int("num_heads", num_heads)
        counts = [positive_int(f"layer_heads[{i}]", h) for i, h in enumerate(layer_heads)]
        too_many = [i for i, h in enumerate(counts) if h > num_heads]
        if too_many:
            raise ValueError(f"layer_heads={counts} exceeds num_heads={num_heads} in layers {too_many}")
        if removed is None:
            layers = {i: (*range(h), *[None] * (num_heads - h)) for i, h in enumerate(counts)}
            return cls(num_heads, layers, original=False)
        extra = sorted(set(removed) - set(range(len(counts))))
        if extra:
            raise ValueError(f"removed heads name layers {extra}, but the model has layers 0..{len(counts) - 1}")
        layers = {}
        for i, kept in enumerate(counts):
            gone = list(removed.get(i, ()))
            if (
                len(gone) != num_heads - kept
                or len(set(gone)) != len(gone)
                or not all(0 <= h < num_heads for h in gone)
            ):
                raise ValueError(
                    f"layer {i}: removed heads {gone} do not leave {kept} of {num_heads} heads "
                    f"(need {num_heads - kept} distinct indices in 0..{num_heads - 1})"
                )
            current = iter(range(kept))  # prune_heads keeps the remaining heads in their order
            layers[i] = tuple(None if h in gone else next(current) for h in range(num_heads))
        return cls(num_heads, layers, original=True)

    def slots(self, layer: int) -> tuple[int | None, ...]:
        """The slots of model layer ``layer``: every head kept when the layer is not listed."""
        return self.layers.get(layer, tuple(range(self.num_heads)))

    def original_index(self, layer: int, head: int) -> int | None:
        """The index before pruning of current head ``head`` of ``layer``, or None when unknown."""
        if not self.original:
            return None
        return self.slots(layer).index(head)

    def pruned(self, layer: int) -> list[int]:
        """The slots of ``layer`` that hold a removed head."""
        return [s for s, h in enumerate(self.slots(layer)) if h is None]

    def summary(self, layers: Sequence[int]) -> str:
        """The heads line "4 layers, 8 of 16 heads kept (8 pruned)" for the given model layers (one per drawn row)."""
        total = len(layers) * self.num_heads
        gone = sum(len(self.pruned(layer)) for layer in layers)
        rows = f"{len(layers)} layer" + ("" if len(layers) == 1 else "s")
        return f"{rows}, {total - gone} of {total} heads kept ({gone} pruned)"
