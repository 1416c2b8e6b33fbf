"""Causal evidence per head: the metric's change when one head's output is replaced.

    effects = head_effects(model, clean, corrupted, metric=logit_difference(answer, wrong), method="patch")
    effects.effects          # [L, H] float64: metric(intervened run) - metric(the run intervened on)
    effects.top(5)           # [(layer, head, effect), ...], largest |effect| first

For each (layer, head) the model runs once with that head's context (its
attention weights times its values, out [B, H, T, Dv], the input of
``out_proj``) replaced, through the layers' head hooks
(``AttentionLayer.register_head_hook``), or, for a transformers model
running ``attn_implementation="multihead"`` (Llama, Qwen, GPT-2, ...),
through the bridge's ``multihead.hf.head_hook`` (``effect_runs.py``)::

    method    the run          head h's context [B, T, Dv] becomes            effect
    zero      clean            0                                              m(run) - m(clean)
    mean      clean            its mean over the clean batch's B*T positions  m(run) - m(clean)
                               (one [Dv] vector per head, the same at every
                               position: positions are averaged too)
    patch     clean            its context on the corrupted input             m(run) - m(clean)
    restore   corrupted        its context on the clean input                 m(run) - m(corrupted)

"patch" is activation patching as in the IOI study (Wang et al. 2022):
which heads carry the difference between the prompts? Starting from the
clean run, a head whose corrupted output moves the metric towards its
corrupted value matters; with the logit difference that effect is negative.
"restore" is the reverse direction (a corrupted run with one head's clean
output: which head alone brings the clean behaviour back; positive for such
a head). ``clean`` and ``corrupted`` then need the same shapes.

**Why before the output projection.** A layer's output is
``out_proj(concat_h ctx_h) = sum_h W[:, cols_h] ctx_h + b``: every output
channel mixes every head, and the bias ``b`` belongs to no head. Zeroing a
head's slice of the layer's output *after* ``out_proj`` (channels
h*Dv .. (h+1)*Dv, a common mistake) removes part of every head's
contribution and part of the bias, and leaves head h's contribution in all
the other channels. Replacing ctx_h before ``out_proj`` changes exactly
head h's term ``W[:, cols_h] ctx_h`` and keeps the bias: zeroing it equals
removing the head (``tools.prune.prune_heads``), which is tested.

Cost: one clean run (and one corrupted run when given), keeping only what
the method needs of the measured layers: for patch/restore the other run's
contexts [B, H, T, Dv], recorded through ``run_with_cache`` (name "z"); for
mean each context's mean [H, Dv], taken as the layer runs (recording every
layer's contexts first would hold L x [B, H, T, Dv] at once); then one
intervention per head.
``batch_size`` interventions share a forward: the input is repeated that
many times along the batch and copy i gets intervention i, so the model's
output is split back into chunks of B for ``metric``. A batched forward
rounds differently from the unbatched one (float tolerance, not bitwise);
``batch_size=1`` runs each intervention at the input's own shape.

Heads: a head is a query head (GQA/MQA: key/value heads are shared, only
the query head's output is replaced). Kinds whose heads are independent
(``independent_heads``: MHA/GQA/MQA, gated, output-gated, collaborative,
differential, MLA) are measured as they are. Kinds whose heads are coupled
are refused with the reason the kind gives (``head_independence``) unless
``coupled_heads=True``; then head h is the output slot h, the context that
reaches ``out_proj`` through head h's columns: for MoH the router-gated
output of head h (the gates of the other heads stay as the router set them
from the layer's input); for DCMHA and talking heads a slot that already
mixes every head's scores, so its effect is that slot's, not head h's own
computation (which also feeds the other slots); for overlapping heads, head
h's own output (its shared projection channels are not touched).

Layers are numbered as ``tools.heads.attention_layers`` numbers them (a
transformers model's: in the order they are first called, its config's L
layers of H heads, all independent); each must run exactly once per forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._checks import positive_int
from ..progress import progress_bar
from .effect_runs import effect_runs
from .heads import eval_mode

__all__ = ["METHODS", "HeadEffects", "head_effects", "logit_difference", "check_measurable"]

METHODS = ("zero", "mean", "patch", "restore")


@dataclass
class HeadEffects:
    """A layers x heads map of one intervention's effect on a metric.

    Attributes:
        effects: [L, H] float64, metric of the intervened run minus metric
            of the run intervened on (``baseline``); H is the most heads of
            any layer; NaN for a head not measured or that a layer lacks.
        method: "zero", "mean", "patch" or "restore".
        clean: the metric on the clean input.
        corrupted: the metric on the corrupted input, None without one.
        layer_names: the L attention modules' names.
        num_heads: each layer's head count.
    """

    effects: torch.Tensor
    method: str
    clean: float
    corrupted: float | None
    layer_names: list[str]
    num_heads: list[int]

    @property
    def baseline(self) -> float:
        """The metric of the run the heads were replaced in: corrupted for "restore", else clean."""
        return self.corrupted if self.method == "restore" else self.clean

    def top(self, k: int = 10) -> list[tuple[int, int, float]]:
        """The ``k`` measured heads with the largest |effect|: (layer, head, effect), largest first."""
        k = positive_int("k", k)
        found = [(i, j, float(v)) for (i, j), v in zip(_pairs(self.effects), self.effects.flatten().tolist()) if v == v]
        return sorted(found, key=lambda t: (-abs(t[2]), t[0], t[1]))[:k]

    def to_dict(self) -> dict:
        """JSON-ready: the method, both metric values and L lists of H effects (None: not measured)."""
        rows = [[None if v != v else v for v in row] for row in self.effects.tolist()]
        return {"method": self.method, "clean": self.clean, "corrupted": self.corrupted, "baseline": self.baseline,
                "layers": self.layer_names, "num_heads": self.num_heads, "effects": rows}  # fmt: skip


def _pairs(table: torch.Tensor) -> list[tuple[int, int]]:
    return [(i, j) for i in range(table.shape[0]) for j in range(table.shape[1])]


# ------------------------------------------------------------------ the ready metric
def logit_difference(answer_id, wrong_id, position: int = -1) -> Callable[[object], float]:
    """The IOI metric: logits[b, position, answer] - logits[b, position, wrong], averaged over the batch.

    Args:
        answer_id, wrong_id: token ids, one int for every batch item or a
            sequence of one int per item.
        position: the query position whose next-token logits are read
            (-1: the last).

    Returns:
        ``metric(output) -> float``; ``output`` is logits [B, T, V] or an
        object with ``.logits`` (a Hugging Face output).

    Raises:
        TypeError / ValueError: ids that are not non-negative ints, a position
            that is not an int; when called: logits that are not [B, T, V], an
            id >= V, a position outside [-T, T) or a list of ids whose length
            is not B.
    """
    answer, wrong = _ids("answer_id", answer_id), _ids("wrong_id", wrong_id)
    if isinstance(position, bool) or not isinstance(position, int):
        raise TypeError(f"position must be an int, got position={position!r}")

    def metric(output) -> float:
        logits = getattr(output, "logits", output)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"logit_difference needs logits [B, T, V], got {shape}")
        B, T, V = logits.shape
        if not -T <= position < T:
            raise ValueError(f"position={position} out of range for {T} positions")
        row = logits[:, position].double()  # (B, V)
        picks = [_per_item(name, ids, B, V).to(row.device) for name, ids in (("answer_id", answer), ("wrong_id", wrong))]
        items = torch.arange(B, device=row.device)
        return float((row[items, picks[0]] - row[items, picks[1]]).mean())

    return metric


def _ids(name: str, value) -> list[int] | int:
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    ):
        raise TypeError(f"{name} must be a token id (an int >= 0) or a list of them, got {name}={value!r}")
    return value if isinstance(value, int) else list(values)


def _per_item(name: str, ids, B: int, V: int) -> torch.Tensor:
    listed = [ids] * B if isinstance(ids, int) else ids
    if len(listed) != B:
        raise ValueError(f"{name} lists {len(listed)} ids for a batch of {B}")
    if max(listed) >= V:
        raise ValueError(f"{name} {max(listed)} is not below the vocabulary size {V}")
    return torch.tensor(listed)


# ------------------------------------------------------------------ checks
def _inputs(name: str, value) -> tuple[torch.Tensor, ...]:
    """The model's positional inputs as a tuple of tensors with one batch size."""
    items = (value,) if isinstance(value, torch.Tensor) else value
    if not isinstance(items, (tuple, list)) or not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError(f"{name} must be a tensor or a tuple of tensors (the model's inputs), got {type(value).__name__}")
    if any(t.dim() == 0 for t in items) or len({t.shape[0] for t in items}) != 1:
        raise ValueError(f"{name}'s tensors need one batch size along dim 0, got shapes {[tuple(t.shape) for t in items]}")
    return tuple(items)


def check_measurable(model: nn.Module, heads: Mapping | None = None, coupled_heads: bool = False) -> None:
    """Refuse, as ``head_effects`` does, a layer of ``heads`` (None: every layer) whose
    kind's heads are coupled, unless ``coupled_heads`` (ValueError with the kind's reason)."""
    runs = effect_runs(model)
    if runs.layers is not None:  # a transformers model's heads are independent
        _check_coupled(runs.layers, runs.names, runs.head_table(heads), coupled_heads)


def _check_coupled(layers, names, table, coupled_heads: bool) -> None:
    for i in table:
        layer = layers[i]
        if not layer.independent_heads and not coupled_heads:
            raise ValueError(
                f"layer {i} ({names[i]}) is {layer.kind!r} attention, whose heads are not independent: "
                f"{layer.head_independence}; pass coupled_heads=True (--coupled-heads) to measure its output "
                "slots instead (docs/effects.md)"
            )


def _value(metric: Callable, output) -> float:
    value = metric(output)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"metric must return a scalar, got a tensor of shape {tuple(value.shape)}")
        return float(value.detach().double().reshape(()))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"metric must return a float or a one-element tensor, got {type(value).__name__}")


# ------------------------------------------------------------------ runs
def _split(output, k: int, B: int, inside: bool = False) -> list:
    """The output of k copies of a batch of B, as k outputs of B: tensors split along dim 0, inside
    tuples, lists and dicts too; plain values in them (str, numbers, None) are repeated."""
    if k == 1:
        return [output]
    if isinstance(output, torch.Tensor):
        if output.dim() == 0 or output.shape[0] != k * B:
            raise ValueError(f"the model's output {tuple(output.shape)} has no batch dimension of {k} x {B} to split "
                             "per intervention; pass batch_size=1")  # fmt: skip
        return list(output.split(B))
    if isinstance(output, Mapping):
        parts = {key: _split(v, k, B, True) for key, v in output.items()}
        return [type(output)({key: p[i] for key, p in parts.items()}) for i in range(k)]
    if isinstance(output, (tuple, list)):
        parts = [_split(v, k, B, True) for v in output]
        rebuild = type(output)._make if hasattr(output, "_fields") else type(output)
        return [rebuild([p[i] for p in parts]) for i in range(k)]
    if inside and (output is None or isinstance(output, (str, bytes, int, float, bool))):
        return [output] * k
    raise TypeError(f"the model's output holds a {type(output).__name__}, which cannot be split per intervention; "
                    "pass batch_size=1")  # fmt: skip


def _averaging(means: dict, i: int) -> Callable:
    """A hook that keeps layer i's head outputs' mean over the batch and the positions, (B, H, T, Dv) -> (H, Dv),
    as it passes (returning None: nothing replaced), so no layer's [B, H, T, Dv] outlives its own call."""

    def hook(out: torch.Tensor) -> None:
        means[i] = out.double().mean(dim=(0, 2))

    return hook


def _replacing(jobs: list[tuple[int, int]], k: int, B: int, source, method: str):
    """A head hook for one layer: of k copies of a batch of B, copy c gets head h replaced, for each (c, h) in ``jobs``."""

    def hook(out):
        if out.shape[0] != k * B:
            raise ValueError(f"a head context of batch {out.shape[0]} in a forward of {k} x {B} inputs")
        out = out.clone()
        for c, h in jobs:
            rows = slice(c * B, (c + 1) * B)
            if method == "zero":
                out[rows, h] = 0.0
            elif method == "mean":
                out[rows, h] = source[h].to(out.dtype)  # (Dv,) over (B, T, Dv)
            else:
                if source.shape[0] != B or out[rows, h].shape != source[:, h].shape:
                    raise ValueError(f"the other run's head context {tuple(source[:, h].shape)} does not fit this "
                                     f"run's {tuple(out[rows, h].shape)}")  # fmt: skip
                out[rows, h] = source[:, h].to(out.dtype)
        return out

    return hook


@torch.no_grad()
def head_effects(
    model: nn.Module,
    clean,
    corrupted=None,
    *,
    metric: Callable[[object], object],
    method: str = "patch",
    heads: Mapping[int, Sequence[int]] | None = None,
    batch_size: int = 8,
    coupled_heads: bool = False,
    progress: bool = False,
) -> HeadEffects:
    """The metric's change when each head's context alone is replaced (the module docstring).

    Args:
        model: a module containing multihead attention layers, or a
            transformers model running ``attn_implementation="multihead"``,
            run as ``model(*inputs)`` (a transformers model's with
            ``use_cache=False`` when it takes it) in eval mode (restored
            afterwards).
        clean: the input, a tensor (token ids [B, T] for a GPT) or a tuple
            of positional tensors, all with batch size B along dim 0 (a
            transformers model takes them in its forward's order: GPT-2's
            second is ``past_key_values``, Llama's ``attention_mask``).
        corrupted: the same for the corrupted prompt: required by "patch"
            and "restore" (then the same shapes as ``clean``); with "zero" and
            "mean" only its metric is reported.
        metric: ``metric(output) -> float or one-element tensor`` on the
            model's output for the B items (``logit_difference`` is ready).
        method: "zero", "mean", "patch" or "restore".
        heads: ``{layer: [head, ...]}`` to measure (None: every head).
        batch_size: interventions per forward (the input repeated that many
            times along dim 0); 1 keeps the input's own shape.
        coupled_heads: also measure kinds whose heads are not independent,
            head h meaning output slot h (module docstring).
        progress: show progress on stderr.

    Returns:
        a ``HeadEffects``.

    Raises:
        TypeError / ValueError: an unknown method, inputs that are not
            tensors or differ in shape, "patch"/"restore" without
            ``corrupted``, heads out of range, batch_size < 1, a metric that
            is not callable or returns no scalar, a coupled kind without
            ``coupled_heads``, a layer that does not run once per forward, a
            model with neither multihead layers nor the bridge's attention.
    """
    if method not in METHODS:
        raise ValueError(f"method={method!r}: unknown; valid: {', '.join(METHODS)}")
    if not callable(metric):
        raise TypeError(f"metric must be callable (output -> float), got {type(metric).__name__}")
    batch_size = positive_int("batch_size", batch_size)
    clean = _inputs("clean", clean)
    if corrupted is not None:
        corrupted = _inputs("corrupted", corrupted)
    if method in ("patch", "restore"):
        if corrupted is None:
            raise ValueError(f"method={method!r} needs a corrupted input (the prompt whose head outputs are swapped in)")
        if [t.shape for t in corrupted] != [t.shape for t in clean]:
            raise ValueError(f"method={method!r} needs clean and corrupted inputs of the same shapes, got "
                             f"{[tuple(t.shape) for t in clean]} and {[tuple(t.shape) for t in corrupted]}")  # fmt: skip
    runs = effect_runs(model)
    table = runs.head_table(heads)
    if runs.layers is not None:  # a transformers model's heads are independent
        _check_coupled(runs.layers, runs.names, table, coupled_heads)
    wanted = sorted(table)

    with eval_mode(model):
        means: dict[int, torch.Tensor] = {}
        averaging = {i: _averaging(means, i) for i in wanted} if method == "mean" else None
        output, kept = runs.forward(clean, averaging, record=wanted if method == "restore" else ())
        clean_value, corrupted_value, kept = _value(metric, output), None, means if method == "mean" else kept
        if corrupted is not None:
            output, other = runs.forward(corrupted, record=wanted if method == "patch" else ())
            corrupted_value = _value(metric, output)
            kept = other if method == "patch" else kept
        base, baseline = (corrupted, corrupted_value) if method == "restore" else (clean, clean_value)
        jobs = [(i, h) for i, chosen in table.items() for h in chosen]
        effects = torch.full((len(runs.num_heads), max(runs.num_heads)), math.nan, dtype=torch.float64)
        groups = [jobs[s : s + batch_size] for s in range(0, len(jobs), batch_size)]
        with progress_bar(len(groups), progress and bool(groups), f"head effects ({method})", "forward") as step:
            for group in groups:
                for (i, h), value in zip(group, _intervened(runs, base, kept, group, method, metric)):
                    effects[i, h] = value - baseline
                step()
    return HeadEffects(effects, method, clean_value, corrupted_value, list(runs.names), list(runs.num_heads))


def _intervened(runs, base, kept, group, method, metric) -> list[float]:
    """The metric of each intervention of ``group`` [(layer, head)], in one forward of len(group) copies."""
    k, B = len(group), base[0].shape[0]
    per_layer: dict[int, list[tuple[int, int]]] = {}
    for c, (i, h) in enumerate(group):
        per_layer.setdefault(i, []).append((c, h))
    inputs = base if k == 1 else tuple(t.repeat(k, *[1] * (t.dim() - 1)) for t in base)
    output, _ = runs.forward(inputs, {i: _replacing(jobs, k, B, kept.get(i), method) for i, jobs in per_layer.items()})
    return [_value(metric, part) for part in _split(output, k, B)]
