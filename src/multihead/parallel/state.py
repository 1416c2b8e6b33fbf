"""A tensor-parallel model's weights and optimizer state in the one-process layout, both ways.

Every parameter of a sharded model is one of three:

    a head shard      a parameter of a split attention layer: its elements are
                      the original's at the layer's ``ShardMap`` indices
                      (gather: all-gather, then scatter into place;
                      distribute: pick this rank's indices)
    a torch DTensor   the MLP's column/row splits: ``full_tensor()`` /
                      ``distribute_tensor``
    a plain tensor    replicated (embeddings, norms): the same everywhere

Names are those of the unsharded model ("blocks.0.attn.qkv_proj.weight",
not the parametrization's "...parametrizations.weight.original"), and the
optimizer state is keyed by the unsharded model's parameter order, so a
checkpoint written from a sharded run loads in one process and back.
All functions here are collective: every rank of the mesh calls them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..modules.base import AttentionLayer

__all__ = ["full_state_dict", "load_full_state_dict", "full_optimizer_state", "load_full_optimizer_state"]


def plain_name(name: str) -> str:
    """"qkv_proj.parametrizations.weight.original" -> "qkv_proj.weight"."""
    return f".{name}".replace(".parametrizations.", ".").removesuffix(".original")[1:]


@dataclass
class Slot:
    """One parameter of the sharded model and how its values map to the full tensor."""

    param: nn.Parameter
    gather: Callable[[torch.Tensor], torch.Tensor]  # a local tensor shaped like the param -> the full tensor
    distribute: Callable[[torch.Tensor], torch.Tensor]  # the full tensor -> this rank's part (the param's type)
    share: torch.Tensor | None = None  # head shards: 1 / the ranks holding each local element (float64)


def _head_slot(layer: AttentionLayer, name: str, param: nn.Parameter) -> Slot:
    plan = layer.tensor_parallel_map
    mesh = layer.out_proj.weight.device_mesh
    rank, shape, index = mesh.get_local_rank(), plan.shapes[name], plan.index[name]

    def local(value: torch.Tensor) -> torch.Tensor:
        return value.to_local() if isinstance(value, DTensor) else value

    def gather(value: torch.Tensor) -> torch.Tensor:
        mine = local(value).contiguous()
        parts = [torch.empty_like(mine) for _ in range(mesh.size())]
        dist.all_gather(parts, mine, group=mesh.get_group())
        full = mine.new_empty(shape)
        for where, part in zip(index, parts):
            full.view(-1)[where.reshape(-1).to(part.device)] = part.reshape(-1)  # copies of a shared element are equal
        return full

    def distribute(full: torch.Tensor) -> torch.Tensor:
        mine = full.reshape(-1)[index[rank].reshape(-1).to(full.device)].view(index[rank].shape)
        if isinstance(param, DTensor):
            return DTensor.from_local(mine, param.device_mesh, param.placements, shape=param.shape,
                                      stride=param.stride(), run_check=False)  # fmt: skip
        return mine

    holders = torch.bincount(torch.cat([i.reshape(-1) for i in index]))
    share = (1.0 / holders[index[rank].reshape(-1)].double()).view(index[rank].shape)
    return Slot(param, gather, distribute, share)


def _plain_slot(param: nn.Parameter) -> Slot:
    if isinstance(param, DTensor):
        return Slot(
            param,
            lambda value: value.full_tensor(),
            lambda full: distribute_tensor(full.to(param.device), param.device_mesh, param.placements),
        )
    return Slot(param, lambda value: value, lambda full: full)


def slots(model: nn.Module, *, tied: bool = False) -> dict[str, Slot]:
    """Every parameter of the sharded ``model`` under its unsharded name: a tied tensor
    under its first name, or (``tied=True``) under each of its names, one shared Slot."""
    out: dict[str, Slot] = {}
    seen: dict[int, Slot] = {}
    layers = {path: m for path, m in model.named_modules() if hasattr(m, "tensor_parallel_map")}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            if tied:
                out[plain_name(name)] = seen[id(param)]
            continue
        owner = max((p for p in layers if p == "" or name.startswith(f"{p}.")), key=len, default=None)
        if owner is None:
            out[name] = seen[id(param)] = _plain_slot(param)
            continue
        inner = plain_name(name[len(owner) + 1 :] if owner else name)
        full_name = f"{owner}.{inner}" if owner else inner
        out[full_name] = seen[id(param)] = _head_slot(layers[owner], inner, param)
    return out


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers, by name (a split layer's buffers are whole on every rank)."""
    state = model.state_dict(keep_vars=True)
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    return {plain_name(n): v for n, v in state.items() if n not in params}


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``state_dict()`` of the unsharded model, on every rank (detached tensors).

    Raises:
        RuntimeError: the copies of a replicated parameter differ between the
            ranks (the same operations on the same inputs keep them equal: a
            difference is a bug, e.g. a dropout drawing other numbers on each rank).
    """
    table = slots(model, tied=True)
    _check_replicated(model, table)
    gathered: dict[int, torch.Tensor] = {}
    state = {}
    for name, slot in table.items():
        if id(slot) not in gathered:
            gathered[id(slot)] = slot.gather(slot.param.detach())
        state[name] = gathered[id(slot)]
    state.update({n: b.detach() for n, b in _buffers(model).items() if n not in state})
    return state


def _check_replicated(model: nn.Module, table: dict[str, Slot]) -> None:
    """Every plain (replicated) parameter is the same on every rank of the split (one all-gather)."""
    layers = [m for m in model.modules() if hasattr(m, "tensor_parallel_map")]
    plain = {n: s.param for n, s in table.items() if not isinstance(s.param, DTensor) and s.share is None}
    if not layers or not plain:
        return
    mesh = layers[0].out_proj.weight.device_mesh
    sums = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().pow(2).sum()]) for p in plain.values()])
    parts = [torch.empty_like(sums) for _ in range(mesh.size())]
    dist.all_gather(parts, sums, group=mesh.get_group())
    differ = [n for i, n in enumerate(plain) if any(not torch.equal(part[i], sums[i]) for part in parts)]
    if differ:
        raise RuntimeError(f"replicated parameters differ between tensor-parallel ranks: {differ}")


@torch.no_grad()
def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy the unsharded ``state`` (every rank holds it whole) into the sharded ``model``.

    Raises:
        ValueError: missing or unexpected names (both listed).
    """
    targets = slots(model)
    buffers = _buffers(model)
    names = set(slots(model, tied=True)) | set(buffers)
    missing, extra = sorted(names - set(state)), sorted(set(state) - names)
    if missing or extra:
        raise ValueError(f"the state does not fit the model: missing {missing}, unexpected {extra}")
    for name, slot in targets.items():
        value = slot.distribute(state[name].to(dtype=slot.param.dtype))
        target = slot.param.to_local() if isinstance(slot.param, DTensor) else slot.param
        target.copy_(value.to_local() if isinstance(value, DTensor) else value)
    for name, buffer in buffers.items():
        buffer.copy_(state[name])


def _optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer, table: dict[str, Slot]) -> list[str]:
    by_id = {id(slot.param): name for name, slot in table.items()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in by_id]
    if missing:
        raise ValueError(f"optimizer parameters {missing} are not parameters of the model")
    return [by_id[id(p)] for p in order]


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, order: list[str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` as an unsharded model's optimizer would hold it.

    Args:
        order: the unsharded model's parameter names in its optimizer's order
            (index i of the result is ``order[i]``).
    """
    table = slots(model)
    names = _optimizer_names(model, optimizer, table)
    index = {name: i for i, name in enumerate(order)}
    state: dict[int, dict[str, Any]] = {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for name, p in zip(names, params):
        entries = optimizer.state.get(p, {})
        state[index[name]] = {
            k: table[name].gather(v) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in entries.items()
        }  # moments shaped like their parameter; 0-d counters as they are
    groups, start = [], 0
    for group in optimizer.param_groups:
        count = len(group["params"])
        # in the unsharded model's order, as an optimizer built over its parameters lists them
        groups.append({**{k: v for k, v in group.items() if k != "params"},
                       "params": sorted(index[n] for n in names[start : start + count])})  # fmt: skip
        start += count
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, full: dict[str, Any],
                              order: list[str]) -> None:  # fmt: skip
    """Load an unsharded optimizer state (every rank holds it whole) into the sharded model's optimizer."""
    table = slots(model)
    names = _optimizer_names(model, optimizer, table)
    position = {name: i for i, name in enumerate(names)}
    state = {}
    for i, entries in full["state"].items():
        name = order[i]
        state[position[name]] = {
            k: table[name].distribute(v) if isinstance(v, torch.Tensor) and v.dim() else v for k, v in entries.items()
        }
    groups, start = [], 0
    for group, own in zip(full["param_groups"], optimizer.param_groups, strict=True):
        count = len(own["params"])
        groups.append({**group, "params": list(range(start, start + count))})
        start += count
    optimizer.load_state_dict({"state": state, "param_groups": groups})
