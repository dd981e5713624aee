"""One training step: the batch's TTT loss against the target's distribution, backward,
clipping, the optimizer and the schedule, and the step's figures summed over ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from eagletrain.train.batches import Batch
from eagletrain.train.parallel import Parallel
from eagletrain.train.sharding import grad_norm_value
from eagletrain.train.ttt import TargetHead, TTTResult, step_denominators


def batch_ttt(
    objective: torch.nn.Module,
    head: TargetHead,
    batch: Batch,
    parallel: Parallel | None = None,
) -> TTTResult:
    """The TTT loss and metrics of one batch, the target distribution from its stored (or
    online) last hidden state. Under data parallelism this rank's batch is its share of the
    global one: losses are normalised by the global mask sums."""
    drafter = objective_drafter(objective)
    with torch.no_grad(), torch.autocast(batch.aux.device.type, enabled=False):
        p, in_vocab = head.distribution(batch.last, drafter.target_ids(), drafter.t2d)
    if parallel is None or not parallel.active:
        return objective(batch, p, in_vocab)
    steps = objective_settings(objective).steps
    denominators = parallel.sum(step_denominators(batch.loss_mask, in_vocab, steps, batch.segments))
    return objective(batch, p, in_vocab, denominators, float(parallel.world))


def unwrapped_objective(objective: torch.nn.Module) -> torch.nn.Module:
    return getattr(objective, "module", objective)  # DDP keeps the objective as .module


def objective_drafter(objective: torch.nn.Module):
    return unwrapped_objective(objective).drafter


def objective_settings(objective: torch.nn.Module):
    return unwrapped_objective(objective).settings


@dataclass
class Optimization:
    """What a step updates: the optimizer, its schedule and the gradient clip."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    grad_clip: float


def train_step(
    objective: torch.nn.Module,
    head: TargetHead,
    batch: Batch,
    opt: Optimization,
    parallel: Parallel,
    autocast: Any,
    stop_requested: bool = False,
) -> tuple[dict[str, Any], bool]:
    """One optimizer step on `batch` (on the device). Returns the step's figures (global:
    losses and accuracies are shares of the global batch; conditional accuracy is this
    rank's) and whether any rank was asked to stop, so that all stop at this step."""
    with autocast:
        r = batch_ttt(objective, head, batch, parallel)
    opt.optimizer.zero_grad(set_to_none=True)
    r.loss.backward()
    drafter = objective_drafter(objective)
    grad_norm = grad_norm_value(torch.nn.utils.clip_grad_norm_(drafter.parameters(), opt.grad_clip))
    opt.optimizer.step()
    opt.scheduler.step()
    steps = len(r.step_loss)
    shares = torch.tensor(
        [
            r.loss.item(),
            *r.step_loss,
            *r.step_acc,
            int(batch.loss_mask.sum()),
            float(stop_requested),
        ],
        dtype=torch.float64,
        device=batch.aux.device,
    )
    shares = parallel.sum(shares).tolist()
    stopping = shares.pop() > 0
    if parallel.active:  # per-rank losses were scaled by the world size
        shares[0] /= parallel.world
    figures = {
        "loss": shares[0],
        "lr": opt.scheduler.get_last_lr()[0],
        "grad_norm": grad_norm,
        "tokens": int(shares[-1]),
        **{f"loss_{j}": v for j, v in enumerate(shares[1 : 1 + steps])},
        **{f"acc_{j}": v for j, v in enumerate(shares[1 + steps : 1 + 2 * steps])},
        **{f"cond_acc_{j}": v for j, v in enumerate(r.step_cond_acc)},
    }
    return figures, stopping
