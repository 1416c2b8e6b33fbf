"""Tensor parallelism on PyTorch's DTensor: heads split over ranks, cut by each kind itself.

    mesh = init_device_mesh("cuda", (2,))      # under torchrun
    model = tensor_parallel(GPT(config), mesh)  # same weights on every rank
    state = full_state_dict(model)              # the one-process state dict

See docs/parallel.md.
"""

from .head_shards import rank_heads
from .plan import tensor_parallel
from .state import full_optimizer_state, full_state_dict, load_full_optimizer_state, load_full_state_dict

__all__ = [
    "tensor_parallel",
    "full_state_dict",
    "load_full_state_dict",
    "full_optimizer_state",
    "load_full_optimizer_state",
    "rank_heads",
]
