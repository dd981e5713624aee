"""Held-out evaluation during training: loss, per-step accuracies and the simulated
acceptance length (leading correct TTT steps + 1), on the same batches as training."""

from __future__ import annotations

from typing import Any

import torch

from eagletrain.drafter import dense_ttt_attention
from eagletrain.train.batches import Batcher
from eagletrain.train.step import batch_ttt, objective_drafter, objective_settings
from eagletrain.train.ttt import TargetHead


def evaluate_heldout(
    objective: torch.nn.Module,
    head: TargetHead,
    batcher: Batcher,
    batch_size: int,
    device: torch.device,
) -> dict[str, Any]:
    """In packed rows when training packs (the same figures, one sequence length for the
    kernels); dense TTT attention (no kernel to compile for a gradient-free pass)."""
    drafter, steps = objective_drafter(objective), objective_settings(objective).steps
    drafter.eval()
    loss, acc, cond_acc = 0.0, [0.0] * steps, [0.0] * steps
    accepted_sum, counted_sum, batches = 0.0, 0, 0
    with torch.no_grad(), dense_ttt_attention(drafter):
        for s in range(0, len(batcher), batch_size):
            units = list(range(s, min(s + batch_size, len(batcher))))
            r = batch_ttt(objective, head, batcher.batch(units).to(device, torch.float32))
            loss += float(r.loss)
            acc = [a + b for a, b in zip(acc, r.step_acc, strict=True)]
            cond_acc = [a + b for a, b in zip(cond_acc, r.step_cond_acc, strict=True)]
            accepted_sum += float((r.accepted * r.counted).sum())
            counted_sum += int(r.counted.sum())
            batches += 1
    drafter.train()
    n = max(batches, 1)
    return {
        "heldout_loss": loss / n,
        "heldout_acc": [a / n for a in acc],
        "heldout_cond_acc": [a / n for a in cond_acc],
        "simulated_acceptance_length": 1.0 + accepted_sum / max(counted_sum, 1),
        "heldout_samples": len(batcher.data),
    }
