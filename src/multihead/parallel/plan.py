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
tensor parallelism does. Dropout draws its own masks on each rank: a run with
dropout follows a one-process run in distribution, not in values.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..modules.base import AttentionLayer
from .head_shards import shard_layer, shard_map

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


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


def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shard ``model`` over ``mesh`` in place and return it.

    Every rank calls this with the same model (same weights: build it with
    the same seed or load the same checkpoint). A single attention layer is
    returned as its rank's new layer (it cannot be replaced in place).

    Args:
        model: a GPT, BertEncoder, SentenceEncoder (MiniLM), or one attention
            layer, on the mesh's device.
        mesh: a 1-D DeviceMesh of the tensor-parallel ranks.

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
        setattr(parent, name, shard_layer(layer, mesh))
    for module in list(model.modules()):
        plan = getattr(type(module), "tensor_parallel_plan", None)
        if plan:
            parallelize_module(module, mesh, {pattern: _STYLES[style]() for pattern, style in plan.items()})
    return model
