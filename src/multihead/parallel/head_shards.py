"""One attention layer split by heads over a tensor-parallel mesh dimension.

Rank r of n keeps query heads [r·H/n, (r+1)·H/n) with the key/value heads
they read, cut by the kind itself (``layer.tensor_parallel_part``: ``select_heads``
for independent heads; Mixture-of-Head keeps its router whole); a kind that
cannot split is refused with its own reason. What each rank
holds:

    out_proj              torch's RowwiseParallel (weight Shard(1), bias
                          Replicate): the head outputs meet in one all-reduce
    every other parameter a DTensor over the mesh: Shard(d) along the one dim
                          the cut shrank (the q|k|v rows of the rank's heads,
                          per-head gates, ...), Replicate when the cut kept it
                          whole (qk_norm gains, ...); the kind's code reads the
                          local shard through a parametrization

The query is the same on every rank; its gradient is the sum of the ranks'
parts, taken by one all-reduce in backward (a DTensor made Replicate from a
local tensor whose gradient is Partial: Megatron's "f"). With n > G a key/value
head is held by n/G ranks (replicated, as Megatron does); the gradient of a
parameter element held by several ranks is summed over them, so the copies
stay equal.

Which element of the original parameter each local element is comes from the
kind's own cut, run once on a copy whose parameters hold their element
numbers (``ShardMap``); a cut that computes instead of selecting is refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
from torch.nn.utils import parametrize

from ..modules.base import AttentionLayer


@dataclass
class ShardMap:
    """Where a sharded layer's parameters come from.

    Attributes:
        heads: [n] the query heads of each rank.
        index: parameter name -> [n] long tensors: for each rank, the flat
            index in the original parameter of every local element (the
            local parameter's shape).
        shapes: parameter name -> the original parameter's shape.
    """

    heads: list[list[int]]
    index: dict[str, list[torch.Tensor]]
    shapes: dict[str, torch.Size]


def rank_heads(num_heads: int, num_kv_heads: int, degree: int, kind: str) -> list[list[int]]:
    """The query heads of each of ``degree`` ranks (contiguous blocks).

    Raises:
        ValueError: H not divisible by the degree, or G neither a multiple
            nor a divisor of it.
    """
    H, G, n = num_heads, num_kv_heads, degree
    if H % n:
        raise ValueError(
            f"tensor parallelism of degree {n} needs the head count to divide: {kind!r} attention has {H} heads"
        )
    if G % n and n % G:
        raise ValueError(
            f"tensor parallelism of degree {n} on {H} heads in {G} key/value groups: each rank must hold whole "
            f"groups (G divisible by {n}) or share one (degree divisible by G={G})"
        )
    per = H // n
    return [list(range(r * per, (r + 1) * per)) for r in range(n)]


def shard_map(layer: AttentionLayer, degree: int) -> ShardMap:
    """Each rank's cut of ``layer``, as element numbers of its parameters.

    Raises:
        ValueError: a kind whose heads are not independent (its reason), head
            counts that do not fit the degree, or a cut that does not only
            select elements.
    """
    heads = rank_heads(layer.num_heads, layer.num_kv_heads, degree, layer.kind)
    layer.tensor_parallel_part(heads[0])  # the kind's refusal, if it cannot split, before any copy
    tagged = copy.deepcopy(layer).to(device="cpu", dtype=torch.float64)
    shapes = {}
    with torch.no_grad():
        for name, p in tagged.named_parameters():
            shapes[name] = p.shape
            p.copy_(torch.arange(p.numel(), dtype=torch.float64).view(p.shape))  # each element its own number
    index: dict[str, list[torch.Tensor]] = {name: [] for name in shapes}
    for r in range(degree):
        local = dict(tagged.tensor_parallel_part(heads[r]).named_parameters())
        if set(local) != set(shapes):
            raise ValueError(f"{layer.kind!r}: its cut has parameters {sorted(local)}, the layer {sorted(shapes)}")
        for name, p in local.items():
            numbers = p.detach()
            if not bool(((numbers == numbers.round()) & (numbers >= 0) & (numbers < shapes[name].numel())).all()):
                raise ValueError(f"{layer.kind!r}: its tensor_parallel_part computes {name} instead of selecting elements")
            index[name].append(numbers.long())
    return ShardMap(heads, index, shapes)


def placement(name: str, index: list[torch.Tensor], shape: torch.Size) -> Shard | Replicate:
    """Replicate when every rank keeps the whole parameter, else Shard along the one dim the cut shrank."""
    local = index[0].shape
    if any(i.shape != local for i in index):
        raise ValueError(f"{name}: the ranks' shards differ in shape {[tuple(i.shape) for i in index]}")
    if local == shape:
        whole = torch.arange(shape.numel()).view(shape)
        if all(torch.equal(i, whole) for i in index):
            return Replicate()
        raise ValueError(f"{name}: a shard of the full shape {tuple(shape)} that reorders its elements")
    dims = [d for d in range(len(shape)) if local[d] != shape[d]]
    if len(dims) != 1:
        raise ValueError(f"{name}: shards {tuple(local)} of {tuple(shape)} differ in more than one dim")
    return Shard(dims[0])


class _Local(nn.Module):
    """Parametrization: the kind's code reads the local shard of a DTensor parameter."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_local() if isinstance(x, DTensor) else x


class _LocalRowwise(RowwiseParallel):
    """torch's RowwiseParallel for an out_proj that already holds this rank's columns."""

    def _partition_linear_fn(self, name, module, device_mesh):
        weight = DTensor.from_local(module.weight.detach(), device_mesh, [Shard(1)], run_check=False)
        module.register_parameter("weight", nn.Parameter(weight, requires_grad=module.weight.requires_grad))
        if module.bias is not None:
            bias = DTensor.from_local(module.bias.detach(), device_mesh, [Replicate()], run_check=False)
            module.register_parameter("bias", nn.Parameter(bias, requires_grad=module.bias.requires_grad))


def _summing_hook(rank: int, index: list[torch.Tensor], mesh: DeviceMesh):
    """A gradient hook summing the elements several ranks hold over those ranks (None when none are shared)."""
    counts = torch.bincount(torch.cat([i.reshape(-1) for i in index]))
    shared = torch.nonzero(counts > 1).reshape(-1)  # original element numbers held by 2+ ranks
    if shared.numel() == 0:
        return None
    mine = index[rank].reshape(-1)
    slot = torch.full((int(counts.numel()),), -1, dtype=torch.long)
    slot[shared] = torch.arange(shared.numel())
    where = torch.nonzero(slot[mine] >= 0).reshape(-1)  # local positions of shared elements
    slots = slot[mine[where]]
    group = mesh.get_group()

    def hook(grad: torch.Tensor) -> torch.Tensor:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        flat = local.reshape(-1).clone()
        buffer = flat.new_zeros(shared.numel()).index_add_(0, slots, flat[where])
        dist.all_reduce(buffer, group=group)  # each shared element: the sum of every holder's part
        flat[where] = buffer[slots]
        out = flat.view(local.shape)
        if isinstance(grad, DTensor):
            return DTensor.from_local(out, grad.device_mesh, grad.placements, shape=grad.shape,
                                      stride=grad.stride(), run_check=False)  # fmt: skip
        return out

    return hook


def _replicated_query(mesh: DeviceMesh, sequence_parallel: bool):
    """A forward pre-hook: the query as a DTensor copy whose gradient is summed over the ranks
    (with ``sequence_parallel``: gathered from the ranks' slices of the sequence, the gradient
    reduce-scattered back)."""

    def hook(layer: AttentionLayer, args: tuple, kwargs: dict):
        if (len(args) > 1 and args[1] is not None) or kwargs.get("key") is not None:
            raise ValueError("a tensor-parallel attention layer attends over its own input: pass no key/value")
        query = args[0] if args else kwargs["query"]
        if sequence_parallel:  # (B, T/n, C) on each rank -> (B, T, C)
            whole = DTensor.from_local(query, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()])
            shared = whole.to_local(grad_placements=[Partial()])
        else:
            shared = DTensor.from_local(query, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        if args:
            return (shared, *args[1:]), kwargs
        return args, {**kwargs, "query": shared}

    return hook


def shard_layer(layer: AttentionLayer, mesh: DeviceMesh, sequence_parallel: bool = False) -> AttentionLayer:
    """This rank's part of ``layer`` (a new layer; ``layer`` is left as it was). With
    ``sequence_parallel`` its input and output are this rank's slice of the sequence.

    Raises:
        ValueError: see :func:`shard_map`.
    """
    degree, rank = mesh.size(), mesh.get_local_rank()
    plan = shard_map(layer, degree)
    columns = torch.cat(plan.index["out_proj.weight"], dim=1)  # the ranks' out_proj columns side by side
    if not torch.equal(columns, torch.arange(columns.numel()).view(plan.shapes["out_proj.weight"])):
        raise ValueError(f"{layer.kind!r}: out_proj's columns are not in head order, so they cannot be row-split")
    local = layer.tensor_parallel_part(plan.heads[rank])
    for name, p in list(local.named_parameters()):
        if name.startswith("out_proj."):
            continue
        where = placement(name, plan.index[name], plan.shapes[name])
        owner_name, _, attr = name.rpartition(".")
        owner = local.get_submodule(owner_name) if owner_name else local
        value = DTensor.from_local(p.detach(), mesh, [where], run_check=False)
        setattr(owner, attr, nn.Parameter(value, requires_grad=p.requires_grad))
        hook = _summing_hook(rank, plan.index[name], mesh)
        if hook is not None:
            getattr(owner, attr).register_hook(hook)
        parametrize.register_parametrization(owner, attr, _Local(), unsafe=True)
    out = _LocalRowwise(output_layouts=Shard(1)) if sequence_parallel else _LocalRowwise()  # reduce-scatter
    parallelize_module(local, mesh, {"out_proj": out})
    local.register_forward_pre_hook(_replicated_query(mesh, sequence_parallel), with_kwargs=True)
    local.tensor_parallel_map = plan
    return local
