"""What tensor parallelism costs per rank, from the model's own layers (no formula kept by hand).

Each rank's attention layer in every block is the kind's own cut of that
block's layer (``tensor_parallel_part`` on a layer built on the meta device;
blocks with heads or options of their own are cut each as it is), so its parameter and key/value-cache sizes
are those the sharded model really holds, replicated key/value heads
included. The MLP is split column- then row-wise (its bias after the row
split is replicated); embeddings, the LM head and norms are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..models.gpt import GPT, GPTConfig
from .head_shards import rank_heads


@dataclass(frozen=True)
class RankCost:
    """Per rank of a tensor-parallel GPT.

    Attributes:
        degree: ranks in the tensor-parallel group.
        parameters: parameters one rank holds.
        kv_cache_bytes_per_token: key/value cache bytes per token of one sequence (all layers).
        all_reduce_bytes_per_token: bytes each all-reduce moves per token and layer
            times the all-reduces of one forward (two per block).
    """

    degree: int
    parameters: int
    kv_cache_bytes_per_token: int
    all_reduce_bytes_per_token: int


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def rank_cost(config: GPTConfig, degree: int, *, bytes_per_element: int = 2) -> RankCost:
    """Rank 0's share of a GPT of ``config`` split ``degree`` ways (the ranks hold equal shares),
    every block cut as its own layer (per-layer heads and options).

    Raises:
        ValueError: head counts that do not fit the degree (naming the block),
            a kind that cannot be split, or an MLP width not divisible by the degree.
    """
    model = GPT(config, device="meta")
    parameters = model.num_parameters() - sum(_count(block) for block in model.blocks)  # replicated
    kv = 0
    for i, block in enumerate(model.blocks):
        attn = block.attn
        try:
            heads = rank_heads(attn.num_heads, attn.num_kv_heads, degree, attn.kind)[0]
        except ValueError as e:
            raise ValueError(f"block {i}: {e}") from None
        local = attn.tensor_parallel_part(heads)
        hidden = block.mlp.fc.out_features
        if hidden % degree:
            raise ValueError(f"the MLP width {hidden} is not divisible by the tensor-parallel degree {degree}")
        mlp = (block.mlp.fc.weight.numel() + block.mlp.fc.bias.numel()) // degree
        mlp += block.mlp.proj.weight.numel() // degree + block.mlp.proj.bias.numel()
        parameters += _count(local) + mlp + _count(block.ln_1) + _count(block.ln_2)
        kv += local.cost(1, bytes_per_element=bytes_per_element).kv_cache_bytes_per_token
    return RankCost(
        degree=degree,
        parameters=parameters,
        kv_cache_bytes_per_token=kv,
        all_reduce_bytes_per_token=0 if degree == 1 else 2 * config.embed_dim * bytes_per_element,
    )
