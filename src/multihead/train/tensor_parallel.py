"""Tensor parallelism in a training run (``TrainConfig.tensor_parallel``).

Under torchrun with N processes and ``tensor_parallel = t``, the ranks form a
2-D mesh (dp = N / t, tp = t), rank r at (r // t, r % t)::

    tp ->      0         1
    dp 0   rank 0    rank 1      one model split by heads (multihead.parallel)
    dp 1   rank 2    rank 3      a second copy, on other batches

The t ranks of a row hold one model split by heads and train on the same
micro-batches; the rows are data parallel: after the last micro-batch's
backward each gradient is averaged over the rows (one all-reduce per
parameter over the "dp" dimension). The gradient norm for clipping counts
every element of the one-process model once (replicated key/value heads,
replicated parameters and the MLP's replicated biases included once).

Checkpoints hold the full model and the full AdamW state in the one-process
names and order (``multihead.parallel.state``), so a run trained with
tensor parallelism resumes with or without it, and its checkpoints load in
one process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from ..models.gpt import GPT, GPTConfig
from ..parallel import tensor_parallel
from ..parallel.costs import rank_cost
from ..parallel.state import full_optimizer_state, full_state_dict, load_full_optimizer_state, slots

__all__ = ["TensorSplit", "check_split", "split_model"]


def check_split(config: GPTConfig, world_size: int, degree: int, shard: bool) -> None:
    """Refuse a degree that does not fit the processes or the model (before anything is written).

    Raises:
        ValueError: the degree does not divide the processes, goes with
            ``shard``, or the model's heads or MLP do not split that many ways.
    """
    if degree == 1:
        return
    if world_size % degree:
        raise ValueError(f"tensor_parallel={degree} must divide the number of processes, {world_size}")
    if shard:
        raise ValueError("tensor_parallel > 1 does not go with shard (FSDP2) yet: the rows are data parallel by "
                         "gradient all-reduce; drop --shard")  # fmt: skip
    rank_cost(config, degree)  # the kind's heads, G and the MLP width must split


@dataclass
class TensorSplit:
    """The mesh of a run with tensor parallelism, and its one-process parameter order."""

    mesh: DeviceMesh
    order: list[str]  # the one-process optimizer's parameters, by name

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp"].size()

    def sync_gradients(self, params: list[nn.Parameter]) -> None:
        """Average every gradient over the data-parallel rows."""
        if self.dp_size == 1:
            return
        group = self.mesh["dp"].get_group()
        for p in params:
            if p.grad is not None:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(local, group=group)
                local /= self.dp_size

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> float:
        """The one-process model's gradient norm; gradients scaled down to ``max_norm`` when above."""
        tp = self.mesh["tp"]
        total = torch.zeros((), dtype=torch.float64)
        grads = []
        for slot in slots(model).values():
            g = slot.param.grad
            if g is None:
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            grads.append(local)
            squares = local.double().pow(2)
            if slot.share is not None:  # a head shard: each element weighted by 1 / its holders
                squares = squares * slot.share.to(squares.device)
            elif not isinstance(g, DTensor) or any(isinstance(p, Replicate) for p in g.placements):
                squares = squares / tp.size()  # the same on every rank: counted once over the tp ranks
            total += squares.sum().cpu()
        dist.all_reduce(total, group=tp.get_group())
        norm = math.sqrt(float(total))
        if norm > max_norm:
            scale = max_norm / (norm + 1e-6)
            for local in grads:
                local.mul_(scale)
        return norm

    def whole(self, values: torch.Tensor) -> torch.Tensor:
        """The sum over the tp ranks of a per-rank part (the gated heads' L0 penalty of each rank's heads)."""
        values = values.clone()
        dist.all_reduce(values, group=self.mesh["tp"].get_group())
        return values

    def model_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return full_state_dict(model)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return full_optimizer_state(model, optimizer, self.order)

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        load_full_optimizer_state(model, optimizer, state, self.order)


def split_model(model: GPT, groups: list[dict[str, Any]], world_size: int, degree: int,
                device: torch.device) -> TensorSplit:  # fmt: skip
    """Split ``model`` (the same weights on every rank) over the "tp" rows of a (dp, tp) mesh, in place.

    ``groups``: the one-process optimizer's parameter groups, built before the
    split (their order names the checkpoint's optimizer entries).
    """
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    order = [names[id(p)] for group in groups for p in group["params"]]
    mesh = init_device_mesh(device.type, (world_size // degree, degree), mesh_dim_names=("dp", "tp"))
    tensor_parallel(model, mesh["tp"])
    return TensorSplit(mesh, order)
