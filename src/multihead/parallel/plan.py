"""``tensor_parallel(model, mesh)``: shard a built model's heads (and MLPs) over a mesh dimension.

What is sharded:

    every attention layer   by heads (``head_shards``): the kind cuts itself
    a model's other layers  as the model class declares in its
                            ``tensor_parallel_plan`` ({module path pattern:
                            "colwise" | "rowwise"}, torch's ColwiseParallel /
                            RowwiseParallel): GPT's MLP fc then proj, BERT's
                            intermediate then output
    everything else         replicated: embeddings, the LM head, norms

A block then does two all-reduces forward (after the attention's out_proj and
after the MLP) and two backward (the gradients of their inputs), as Megatron's
tensor parallelism does.

``sequence_parallel=True`` (Megatron's sequence parallelism, for a model that
declares a ``sequence_parallel_plan``): between the split layers each rank
holds only its slice of the sequence (T / n tokens), so norms, dropout and
the residual stream work on 1/n of the activations; each all-reduce becomes
a reduce-scatter after the layer and an all-gather before the next, the same
bytes in all. The plan names the norms (torch's SequenceParallel), the module
whose input is cut into slices and the one whose output is gathered again.
T must be divisible by n: decoding one token at a time needs a model split
without it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from ..modules.base import AttentionLayer
from .head_shards import shard_layer, shard_map


def _style(name: str, sequence_parallel: bool):
    """torch's style for a declared split; with sequence parallelism the slices of the sequence come in and go out."""
    if name == "colwise":
        return ColwiseParallel(input_layouts=Shard(1)) if sequence_parallel else ColwiseParallel()
    return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()


def _slice_sequence(mesh: DeviceMesh):
    """A forward pre-hook: the whole sequence (the same on every rank) -> this rank's slice."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        x = args[0]
        if kwargs.get("kv_cache") is not None or x.shape[1] % mesh.size():
            raise ValueError(
                f"sequence parallelism over {mesh.size()} ranks needs a sequence divisible by {mesh.size()} and no "
                f"cache, got {x.shape[1]} tokens{' with a cache' if kwargs.get('kv_cache') is not None else ''}: "
                "decode with a model split without it"
            )
        part = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(1)])
        return (part.to_local(), *args[1:]), kwargs  # (B, T, C) -> (B, T/n, C)

    return hook


def _gather_sequence(mesh: DeviceMesh):
    """A forward hook: the ranks' slices -> the whole sequence on every rank."""

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return DTensor.from_local(output, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    return hook


def _check_mesh(mesh: object) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"tensor_parallel takes a 1-D mesh (or one named dimension of a larger mesh, mesh['tp']); got "
            f"{mesh.ndim} dimensions {mesh.mesh_dim_names}"
        )
    return mesh


def _attention_layers(model: nn.Module) -> list[tuple[str, AttentionLayer]]:
    """(path, layer) of every outermost attention layer in ``model`` (the model itself: path "")."""
    found: list[tuple[str, AttentionLayer]] = []
    for path, module in model.named_modules():
        if isinstance(module, AttentionLayer) and not any(path.startswith(f"{p}.") for p, _ in found if p):
            found.append((path, module))
    return found


def tensor_parallel(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` over ``mesh`` in place and return it.

    Every rank calls this with the same model (same weights: build it with
    the same seed or load the same checkpoint). A single attention layer is
    returned as its rank's new layer (it cannot be replaced in place).

    Args:
        model: a GPT, BertEncoder, SentenceEncoder (MiniLM), or one attention
            layer, on the mesh's device.
        mesh: a 1-D DeviceMesh of the tensor-parallel ranks.
        sequence_parallel: slice the sequence between the split layers
            (see the module docstring); the model must declare a
            ``sequence_parallel_plan``.

    Returns:
        the sharded model.

    Raises:
        TypeError: not a module, or not a DeviceMesh.
        ValueError: a mesh of more than one dimension, a kind whose heads
            are not independent, head counts that do not fit the mesh
            (every check runs before anything is changed).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    mesh = _check_mesh(mesh)
    layers = _attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} contains no multihead attention layer to shard")
    sequence_plan = getattr(type(model), "sequence_parallel_plan", None)
    if sequence_parallel and sequence_plan is None:
        raise ValueError(f"{type(model).__name__} declares no sequence_parallel_plan: split it without "
                         "sequence_parallel")  # fmt: skip
    for path, layer in layers:  # every check before any change
        try:
            shard_map(layer, mesh.size())
        except ValueError as e:
            raise ValueError(f"{path or type(model).__name__}: {e}") from None
    if layers[0][0] == "":
        return shard_layer(model, mesh)
    for path, layer in layers:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, name, shard_layer(layer, mesh, sequence_parallel))
    for module in list(model.modules()):
        plan = getattr(type(module), "tensor_parallel_plan", None)
        if plan:
            styles = {pattern: _style(style, sequence_parallel) for pattern, style in plan.items()}
            parallelize_module(module, mesh, styles)
    if sequence_parallel:
        norms = {pattern: SequenceParallel(use_local_output=True) for pattern in sequence_plan["norms"]}
        parallelize_module(model, mesh, norms)
        model.get_submodule(sequence_plan["slice"]).register_forward_pre_hook(_slice_sequence(mesh), with_kwargs=True)
        model.get_submodule(sequence_plan["gather"]).register_forward_hook(_gather_sequence(mesh))
    return model
