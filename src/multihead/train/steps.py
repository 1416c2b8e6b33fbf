"""The pieces of a training step that do not depend on the run: AdamW's parameter
groups and the validation pass (``multihead.train.loop`` runs them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.gpt import GPT
from .config import TrainConfig
from .world import World

__all__ = ["parameter_groups", "validation_loss"]


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: [{"params": decayed, "weight_decay": weight_decay},
    {"params": the rest, "weight_decay": 0.0}].

    Decayed: parameters with 2 or more dimensions that are not embeddings
    (``nn.Embedding`` weights, also when tied to the LM head). Not decayed:
    biases, norm gains, 1-D gates, embeddings. Each tied tensor appears once.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, rest = [], []
    for p in model.parameters():  # tied tensors once
        if p.requires_grad:
            (decay if p.dim() >= 2 and id(p) not in embeddings else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


# ------------------------------------------------------------------ steps
def validation_loss(model: GPT, sets, config: TrainConfig, world: World, device, autocast,
                    data: tuple[int, int] | None = None) -> float:  # fmt: skip
    """Mean LM loss (nats per token) over the fixed validation batches, rows
    split over the data-parallel ranks (``data`` = (rank, size); default
    every process), in eval mode under no_grad. Every rank runs the same
    number of forwards (grad_accum per batch), as FSDP2's all-gathers need."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (loss sum, token count)
    rank, size = data or (world.rank, world.size)
    rows = config.batch_size // size
    chunk = rows // config.grad_accum
    with torch.no_grad():
        for x, y in sets:
            x, y = x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]
            for i in range(0, rows, chunk):
                xc, yc = x[i : i + chunk].to(device), y[i : i + chunk].to(device)
                with autocast():
                    logits = model(xc)  # (b, T, V)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), yc.reshape(-1), reduction="sum")
                total[0] += loss.double()
                total[1] += yc.numel()
    if world.size > 1:
        dist.all_reduce(total)
    model.train()
    return float(total[0] / total[1])
