"""Acceptance figures of speculative decoding cycles: tau pooled over cycles, per-position
acceptance, the share of cycles no drafter could have extended (the target's token outside
the draft vocabulary), and bootstrap confidence intervals over prompts (prompts, not
cycles, are the sampled unit; training's held-out replay resamples its rows): of one
drafter's tau, and of two drafters' ratio on the same prompts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


def pooled_tau(accepted_per_cycle: Sequence[int]) -> float:
    """Tokens per draft-verify cycle including the target's bonus token, pooled over cycles."""
    if not accepted_per_cycle:
        return 0.0
    return sum(a + 1 for a in accepted_per_cycle) / len(accepted_per_cycle)


def per_position_acceptance(accepted_per_cycle: Sequence[int], k: int) -> list[float]:
    """Fraction of cycles whose j-th draft token (j = 1..k) was accepted."""
    cycles = max(len(accepted_per_cycle), 1)
    return [sum(a >= j for a in accepted_per_cycle) / cycles for j in range(1, k + 1)]


def tau_interval(
    per_prompt: Sequence[tuple[int, int]], level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """The `level` percentile-bootstrap interval of the pooled tau from each prompt's
    (tokens, cycles), resampling prompts with replacement."""
    used = [(t, c) for t, c in per_prompt if c]
    if not used:
        return (0.0, 0.0)
    tokens = np.array([t for t, _ in used], dtype=np.float64)
    cycles = np.array([c for _, c in used], dtype=np.float64)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(used), size=(BOOTSTRAP_RESAMPLES, len(used)))
    taus = tokens[picks].sum(1) / cycles[picks].sum(1)
    low, high = np.quantile(taus, [(1 - level) / 2, (1 + level) / 2])
    return float(low), float(high)


def paired_tau_ratio(
    base: Sequence[tuple[float, int]],
    new: Sequence[tuple[float, int]],
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float, float]:
    """The ratio of two drafters' pooled tau on the same prompts (each prompt's (tokens,
    cycles), in the same order) and its `level` bootstrap interval, resampling prompts
    jointly: a prompt's own difficulty then cancels, so the interval is narrower than two
    separate intervals would suggest."""
    if len(base) != len(new) or not base:
        raise ValueError(f"paired prompts differ in number: {len(base)} against {len(new)}")
    a = np.array(base, dtype=np.float64)
    b = np.array(new, dtype=np.float64)
    ratio = (b[:, 0].sum() / b[:, 1].sum()) / (a[:, 0].sum() / a[:, 1].sum())
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(a), size=(BOOTSTRAP_RESAMPLES, len(a)))
    taus_a = a[picks, 0].sum(1) / a[picks, 1].sum(1)
    taus_b = b[picks, 0].sum(1) / b[picks, 1].sum(1)
    low, high = np.quantile(taus_b / taus_a, [(1 - level) / 2, (1 + level) / 2])
    return float(ratio), float(low), float(high)


def tokens_and_cycles(accepted_per_cycle: Sequence[int]) -> tuple[int, int]:
    """One prompt's tokens (accepted drafts plus a bonus a cycle) and cycles."""
    return sum(a + 1 for a in accepted_per_cycle), len(accepted_per_cycle)


def out_of_vocab_share(
    accepted_per_cycle: Sequence[int], bonus_tokens: Sequence[int], in_draft_vocab, k: int
) -> float:
    """Share of cycles that ended early on a target token outside the draft vocabulary:
    the drafter could not have proposed it, whatever it had learned. `in_draft_vocab(t)`
    says whether target token t is in the draft vocabulary."""
    if not accepted_per_cycle:
        return 0.0
    ended = sum(
        1
        for a, t in zip(accepted_per_cycle, bonus_tokens, strict=True)
        if a < k and not in_draft_vocab(t)
    )
    return ended / len(accepted_per_cycle)
