"""FSDP2 for ``multihead train --shard``: wrap, gather and scatter full states.

``shard_model(model, device, world_size)`` applies
``torch.distributed.fsdp.fully_shard`` to every block and then to the GPT, so
each of N processes keeps 1/N of every parameter (a DTensor sharded on dim 0)
and the matching slice of its gradient and AdamW state::

    GPT  (root: embeddings, ln_f, tied lm_head)     fully_shard(model)
     +-- blocks[0]                                  fully_shard(block)
     +-- blocks[1]                                  fully_shard(block)
     ...

A block's full weights exist only while its forward or backward runs (an
all-gather before, a reduce-scatter of the gradients after).

Checkpoints stay the full model, in the very format of an unsharded run, so a
run may resume with or without ``--shard`` and with any number of processes:

- weights: ``full_model_state`` gathers the full state dict to rank 0 (CPU);
  a resumed run loads the weights into the model before it is sharded;
- optimizer: ``torch.distributed.checkpoint.state_dict`` speaks of parameters
  by name (``{"state": {"blocks.0.mlp.fc.weight": {...}}, "param_groups":
  [{"params": ["blocks.0.mlp.fc.weight", ...]}]}``), the checkpoint by index in
  the optimizer's parameter order (``optimizer.state_dict()``'s form:
  ``{"state": {0: {...}}, "param_groups": [{"params": [0, ...]}]}``).
  ``full_optimizer_state`` gathers and converts names -> indices;
  ``load_full_optimizer_state`` converts indices -> names and gives every
  rank its slice of each full tensor (every rank reads the checkpoint).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ..models.gpt import GPT

__all__ = [
    "shard_model",
    "parameter_names",
    "full_model_state",
    "full_optimizer_state",
    "load_full_optimizer_state",
    "full_value",
    "unsharded_copy",
]

_GATHER_TO_RANK0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_model(model: GPT, device: torch.device, world_size: int) -> GPT:
    """Shard ``model`` in place over ``world_size`` processes (every block, then the root).

    Every rank must call it, with the same (identical) weights. Build the
    optimizer afterwards: its parameters are the sharded DTensors.

    Args:
        model: the GPT, on ``device``.
        device: this rank's device ("cpu": gloo, "cuda:<local rank>": nccl).
        world_size: the processes of the default process group.

    Returns:
        ``model`` itself, now also an ``FSDPModule``
        (``set_requires_gradient_sync``, ``reshard``, ...).
    """
    mesh = init_device_mesh(device.type, (world_size,))  # 1-D: every rank holds 1/N of each parameter
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The name of each optimizer parameter, in the optimizer's order (index i -> name).

    A tensor registered under two names (the tied embedding and LM head) takes
    its first name in ``model.named_parameters()``, as torch's state-dict
    helpers do.

    Raises:
        ValueError: an optimizer parameter that is not one of ``model``'s.
    """
    names: dict[int, str] = {}
    for name, p in model.named_parameters():  # tied tensors once, under their first name
        names.setdefault(id(p), name)
    order = [p for group in optimizer.param_groups for p in group["params"]]
    missing = [i for i, p in enumerate(order) if id(p) not in names]
    if missing:
        raise ValueError(f"optimizer parameters {missing} are not parameters of the model")
    return [names[id(p)] for p in order]


def _same_group_count(groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer) -> None:
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the optimizer state has {len(groups)} parameter group(s), the optimizer {len(optimizer.param_groups)}"
        )


def full_model_state(model: GPT) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on CPU in rank 0, ``{}`` elsewhere; collective."""
    return get_model_state_dict(model, options=_GATHER_TO_RANK0)


def full_value(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective: every rank), a plain tensor as it is.

    ``clip_grad_norm_`` over sharded parameters returns the global norm as a
    DTensor; this makes it a plain tensor.
    """
    return value.full_tensor() if isinstance(value, DTensor) else value


def full_optimizer_state(model: GPT, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The full optimizer state, keyed by parameter index as ``optimizer.state_dict()``
    of an unsharded model is; on CPU in rank 0, ``{}`` elsewhere. Collective.
    """
    names = parameter_names(model, optimizer)
    named = get_optimizer_state_dict(model, optimizer, options=_GATHER_TO_RANK0)
    if not named:
        return {}
    _same_group_count(named["param_groups"], optimizer)
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(named["state"]) - set(index))
    if unknown:
        raise ValueError(f"optimizer state for {unknown}, which are not optimizer parameters {names}")
    state = {index[name]: dict(entries) for name, entries in named["state"].items()}
    groups, start = [], 0
    for group, own in zip(named["param_groups"], optimizer.param_groups, strict=True):
        count = len(own["params"])
        if list(group["params"]) != names[start : start + count]:
            raise ValueError(
                f"optimizer parameter group {len(groups)} lists {group['params']}, expected "
                f"{names[start : start + count]}"
            )
        groups.append({**group, "params": list(range(start, start + count))})
        start += count
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def load_full_optimizer_state(model: GPT, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load a full, index-keyed optimizer state (as ``optimizer.state_dict()`` of an
    unsharded model gives) into the optimizer of the sharded ``model``.

    Every rank passes the same full state (each read the checkpoint); torch
    scatters each tensor from rank 0's copy (``distribute_tensor``), so each
    rank keeps only its slice. Collective.

    Raises:
        ValueError: an index that is not one of the optimizer's parameters,
            another number of groups, or a group of other indices than the
            optimizer's (each message names both).
    """
    names = parameter_names(model, optimizer)
    bad = sorted(i for i in state_dict["state"] if not 0 <= i < len(names))
    if bad:
        raise ValueError(f"optimizer state for parameter(s) {bad}, the optimizer has {len(names)}")
    _same_group_count(state_dict["param_groups"], optimizer)
    groups, start = [], 0
    for group, own in zip(state_dict["param_groups"], optimizer.param_groups, strict=True):
        count = len(own["params"])
        if list(group["params"]) != list(range(start, start + count)):
            raise ValueError(
                f"optimizer parameter group {len(groups)} holds indices {group['params']}, the optimizer's "
                f"holds {start}..{start + count - 1}"
            )
        groups.append({**group, "params": names[start : start + count]})
        start += count
    named = {"state": {names[i]: dict(entries) for i, entries in state_dict["state"].items()}, "param_groups": groups}
    set_optimizer_state_dict(model, optimizer, named, options=StateDictOptions(full_state_dict=True))


def unsharded_copy(model: GPT, device: torch.device) -> GPT:
    """A plain GPT on ``device`` with the full weights of the sharded ``model``, on
    every rank; collective. The weights are gathered one tensor at a time into
    the copy (never a second full state dict), and the copy's random
    initialisation, overwritten at once, leaves the caller's generators as they were.
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        copy = GPT(model.config, device=device)
    sharded = model.state_dict()  # DTensors (parameters) and plain tensors (buffers), the same names
    with torch.no_grad():
        for name, target in copy.state_dict().items():  # the same order on every rank
            target.copy_(full_value(sharded[name]))
    return copy
