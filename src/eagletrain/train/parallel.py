"""Data parallelism under torchrun: one process per GPU (or CPU process with gloo).

torchrun sets RANK / WORLD_SIZE / LOCAL_RANK and the rendezvous; without them this is a
single process and every helper is a no-op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def device(self, device: torch.device) -> torch.device:
        if device.type == "cuda":
            torch.cuda.set_device(self.local_rank)
            return torch.device("cuda", self.local_rank)
        return device

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over ranks (in place)."""
        if self.active:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def close(self) -> None:
        if self.active and dist.is_initialized():
            dist.destroy_process_group()


def init_parallel(device: torch.device) -> Parallel:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Parallel()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Parallel(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
