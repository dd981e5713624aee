"""How the TTT objective is spread over ranks: DDP (replicas, gradients all-reduced) or FSDP
(torch.distributed.fsdp.fully_shard: parameters, gradients and optimizer state sharded),
and whole state dicts out of and back into either. The drafter itself knows nothing of it.

Under FSDP the objective is the root unit (its forward gathers every parameter) and the
decoder layer a unit of its own; gathering a full state dict is a collective, so every rank
calls these helpers and rank 0 writes what they return.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from eagletrain.train.parallel import Parallel

Mode = Literal["ddp", "fsdp"]


def distribute(objective: torch.nn.Module, parallel: Parallel, mode: Mode) -> torch.nn.Module:
    """The module to call for training (`objective` itself when single-process)."""
    if not parallel.active:
        return objective
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        fully_shard(objective.drafter.midlayer)
        fully_shard(objective)
        return objective
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(objective)


def is_sharded(module: torch.nn.Module) -> bool:
    return any(type(p).__name__ == "DTensor" for p in module.parameters())


def _options(**kwargs: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the module's state dict, whole, on the CPU (rank 0 under FSDP; the
    other ranks get an empty dict)."""
    if not is_sharded(module):
        return {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(cpu_offload=True))


def load_full_model_state(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    if not is_sharded(module):
        module.load_state_dict(state, strict=True)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(module, state, options=_options(broadcast_from_rank0=True))


def full_optimizer_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer's state dict, whole; under FSDP keyed by parameter name."""
    if not is_sharded(module):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=_options(cpu_offload=True))


def load_full_optimizer_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    if not is_sharded(module):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=_options(broadcast_from_rank0=True))


def grad_norm_value(norm: torch.Tensor) -> float:
    """clip_grad_norm_'s total norm as a float (a DTensor under FSDP)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
