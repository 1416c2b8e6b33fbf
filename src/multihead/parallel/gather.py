"""The full, one-process state dict of a tensor-parallel model (for checkpoints and checks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..modules.base import AttentionLayer


def _plain_name(name: str) -> str:
    """"qkv_proj.parametrizations.weight.original" -> "qkv_proj.weight"."""
    return f".{name}".replace(".parametrizations.", ".").removesuffix(".original")[1:]


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _gathered_layer(layer: AttentionLayer) -> dict[str, torch.Tensor]:
    """A sharded attention layer's parameters in the original layout, from every rank's shard."""
    plan = layer.tensor_parallel_map
    mesh = layer.out_proj.weight.device_mesh
    group = mesh.get_group()
    params = {}
    for name, p in layer.named_parameters():
        params[_plain_name(name)] = _local(p.detach())
    out = {}
    for name, shape in plan.shapes.items():
        local = params[name].contiguous()
        parts = [torch.empty_like(local) for _ in range(mesh.size())]
        dist.all_gather(parts, local, group=group)
        full = local.new_empty(shape)
        for index, part in zip(plan.index[name], parts):
            full.view(-1)[index.reshape(-1)] = part.reshape(-1)
        out[name] = full
    return out


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as the unsharded model has it, on every rank.

    Collective: every rank of the mesh calls it. Parameters held by several
    ranks (replicated key/value heads) are taken from each holder in turn;
    their copies are equal.
    """
    state: dict[str, torch.Tensor] = {}
    sharded: list[str] = []
    for path, module in model.named_modules():
        if any(p == "" or path == p or path.startswith(f"{p}.") for p in sharded):
            continue
        prefix = f"{path}." if path else ""
        if isinstance(module, AttentionLayer) and hasattr(module, "tensor_parallel_map"):
            sharded.append(path)
            state.update({prefix + k: v for k, v in _gathered_layer(module).items()})
            params = {_plain_name(n) for n, _ in module.named_parameters()}
            for name, value in module.state_dict().items():  # the persistent buffers
                if _plain_name(name) not in params:
                    state[prefix + name] = value.detach()
            continue
        for name, p in module.named_parameters(recurse=False):
            state[prefix + name] = p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                state[prefix + name] = buffer.detach()
    return state
