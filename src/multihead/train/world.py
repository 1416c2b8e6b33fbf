"""The processes of a training run: ranks under torchrun, the device, the generators.

``World.from_env()`` reads torchrun's variables (``WORLD_SIZE``, ``RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); one plain process is rank 0 of 1.
``rng_states`` / ``restore_rng`` save and restore every rank's torch
generators, which a checkpoint holds so a resumed run draws the same
dropout and gate noise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import TrainConfig

__all__ = ["World", "rng_states", "restore_rng", "training_device"]


@dataclass
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @classmethod
    def from_env(cls) -> World:
        def env(name: str, default: int) -> int:
            value = os.environ.get(name, str(default))
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} is not an int") from None

        size = env("WORLD_SIZE", 1)
        if size <= 1:
            return cls()
        return cls(env("RANK", 0), size, env("LOCAL_RANK", 0), env("LOCAL_WORLD_SIZE", size))

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over ranks of a float tensor (unchanged with one process)."""
        if self.size > 1:
            values = values.clone()
            dist.all_reduce(values)
            values /= self.size
        return values


def rng_states(world: World, device: torch.device) -> dict[str, torch.Tensor]:
    """Every rank's generator states ("cpu.<rank>", "cuda.<rank>"); collective under DDP."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    out = {}
    for kind, state in states.items():
        if world.size > 1:
            local = state.to(device)
            gathered = [torch.empty_like(local) for _ in range(world.size)]
            dist.all_gather(gathered, local)
            out.update({f"{kind}.{r}": g.cpu() for r, g in enumerate(gathered)})
        else:
            out[f"{kind}.0"] = state
    return out


def restore_rng(rng: dict[str, torch.Tensor], world: World, device: torch.device) -> None:
    if f"cpu.{world.rank}" in rng:
        torch.set_rng_state(rng[f"cpu.{world.rank}"])
    if device.type == "cuda" and f"cuda.{world.rank}" in rng:
        torch.cuda.set_rng_state(rng[f"cuda.{world.rank}"], device)


def training_device(config: TrainConfig, world: World) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch finds no CUDA device")
    device = torch.device("cuda", world.local_rank)
    torch.cuda.set_device(device)
    return device
