"""Held-out evaluation during training: loss, per-step accuracies, the simulated
acceptance length (leading correct TTT steps + 1 at every position whose target token is
in the draft vocab) and the chain tau a served chain of `chain_steps` drafts would reach on
the same replies (cycles replayed on the unroll: each starts where the last one's bonus
token left off, a target token outside the draft vocab ends one), on the same batches as
training. The chain tau's 95% interval is a bootstrap over the batcher's rows (a sample,
or a packed row of whole samples), the units the replies come in."""

from __future__ import annotations

from typing import Any

import torch

from eagletrain.decode.acceptance import tau_interval
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
    chain_steps: int = 3,
) -> dict[str, Any]:
    """In packed rows when training packs (the same figures, one sequence length for the
    kernels); dense TTT attention (no kernel to compile for a gradient-free pass)."""
    drafter, steps = objective_drafter(objective), objective_settings(objective).steps
    drafter.eval()
    loss, acc, cond_acc = 0.0, [0.0] * steps, [0.0] * steps
    accepted_sum, counted_sum, batches = 0.0, 0, 0
    chain_steps = min(chain_steps, steps)
    per_row: list[tuple[int, int]] = []  # (tokens, cycles) of each row's replayed chain
    with torch.no_grad(), dense_ttt_attention(drafter):
        for s in range(0, len(batcher), batch_size):
            units = list(range(s, min(s + batch_size, len(batcher))))
            r = batch_ttt(objective, head, batcher.batch(units).to(device, torch.float32))
            loss += float(r.loss)
            acc = [a + b for a, b in zip(acc, r.step_acc, strict=True)]
            cond_acc = [a + b for a, b in zip(cond_acc, r.step_cond_acc, strict=True)]
            accepted_sum += float((r.accepted * r.counted).sum())
            counted_sum += int(r.counted.sum())
            per_row += replay_rows(r.accepted, r.startable, chain_steps)
            batches += 1
    drafter.train()
    n = max(batches, 1)
    chain_tokens, chain_cycles = sum(t for t, _ in per_row), sum(c for _, c in per_row)
    return {
        "heldout_loss": loss / n,
        "heldout_acc": [a / n for a in acc],
        "heldout_cond_acc": [a / n for a in cond_acc],
        "simulated_acceptance_length": 1.0 + accepted_sum / max(counted_sum, 1),
        "chain_tau": chain_tokens / max(chain_cycles, 1),
        "chain_tau_ci": list(tau_interval(per_row)),
        "chain_steps": chain_steps,
        "chain_cycles": chain_cycles,
        "chain_rows": len(per_row),
        "heldout_samples": len(batcher.data),
        "chain_per_row": per_row,  # for paired comparisons of runs on the same rows
    }


def replay_rows(
    accepted: torch.Tensor, startable: torch.Tensor, steps: int
) -> list[tuple[int, int]]:
    """(tokens, cycles) of served chain decoding with `steps` drafts, replayed on the unroll
    of each row."""
    rows = []
    for leading, start in zip(accepted.tolist(), startable.tolist(), strict=True):
        cycles = chain_cycles(leading, start, steps)
        rows.append((sum(cycles) + len(cycles), len(cycles)))
    return rows


def chain_cycles(leading: list[int], startable: list[bool], steps: int) -> list[int]:
    """Drafts accepted per cycle of served chain decoding, walked through one row of the
    unroll (served cycles and the unroll agree cycle by cycle: bench/acceptance_gap.py). A
    reply's first token comes from the target's prefill; a cycle starting at index i
    accepts min(leading[i], steps) drafts, and the next starts one past them."""
    accepted, i = [], 0
    while i < len(startable):
        if not startable[i] or i == 0 or not startable[i - 1]:
            i += 1  # outside a reply, or its first token (the prefill's)
            continue
        k = min(leading[i], steps)
        accepted.append(k)
        i += k + 1
    return accepted
