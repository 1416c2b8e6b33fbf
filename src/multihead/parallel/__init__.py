"""Tensor parallelism on PyTorch's DTensor: heads split over ranks, cut by each kind itself.

    mesh = init_device_mesh("cuda", (2,))      # under torchrun
    model = tensor_parallel(GPT(config), mesh)  # same weights on every rank
    state = full_state_dict(model)              # the one-process state dict

See docs/parallel.md.
"""

from .gather import full_state_dict
from .head_shards import rank_heads
from .plan import tensor_parallel

__all__ = ["tensor_parallel", "full_state_dict", "rank_heads"]
