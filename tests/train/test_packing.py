"""Packing samples into fixed-length rows changes the layout, never the objective: the TTT
loss, its metrics and its gradients over packed rows equal those over the same samples
padded one per row (positions restart, attention and loss stop at sample boundaries)."""

from __future__ import annotations

import random

import pytest
import torch
from test_drafter import tiny_drafter

from eagletrain.train.batches import Batch
from eagletrain.train.packing import pack_rows
from eagletrain.train.ttt import TTTSettings, ttt_forward


def test_pack_rows_places_every_sample_once_within_the_row_length():
    rng = random.Random(0)
    lengths = [rng.randint(1, 40) for _ in range(200)]
    rows = pack_rows(lengths, 64)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(200))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert sum(lengths) / (64 * len(rows)) > 0.9  # first-fit decreasing wastes little
    assert pack_rows(lengths, 64) == rows  # deterministic
    with pytest.raises(ValueError, match="sample 1 has 70 tokens"):
        pack_rows([3, 70], 64)


def first_fit_by_scan(lengths: list[int], row_tokens: int) -> list[list[int]]:
    """The plain first-fit decreasing (every row scanned), as pack_rows was until 2026-12-06:
    its rows must not change, or a resumed run would see other batches."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = next((r for r, free in enumerate(room) if lengths[i] <= free), None)
        if r is None:
            rows.append([i])
            room.append(row_tokens - lengths[i])
        else:
            rows[r].append(i)
            room[r] -= lengths[i]
    return rows


@pytest.mark.parametrize(
    ("n", "low", "high", "row"),
    [(1, 1, 9, 16), (3000, 1, 1024, 1024), (5000, 20, 300, 1024), (777, 1, 64, 64)],
)
def test_pack_rows_gives_the_rows_of_a_plain_first_fit_scan(n, low, high, row):
    rng = random.Random(n)
    lengths = [rng.randint(low, high) for _ in range(n)]
    assert pack_rows(lengths, row) == first_fit_by_scan(lengths, row)


def random_samples(lengths: list[int], seed: int) -> list[tuple[torch.Tensor, ...]]:
    """(aux, last, ids, loss mask, target distribution, in draft vocab) per sample."""
    torch.manual_seed(seed)
    samples = []
    for n in lengths:
        aux = torch.randn(n, 3 * 32, dtype=torch.float64)
        ids = torch.randint(0, 50, (n,))
        mask = torch.rand(n) < 0.8
        p = torch.softmax(3 * torch.randn(n, 20, dtype=torch.float64), -1)
        in_vocab = torch.rand(n) < 0.9
        samples.append((aux, torch.zeros(n, 32, dtype=torch.float64), ids, mask, p, in_vocab))
    return samples


def padded_and_packed(samples, rows, row_tokens):
    """The same samples as a padded batch (one per row) and as packed rows."""
    b, longest = len(samples), max(s[0].shape[0] for s in samples)
    width = samples[0][0].shape[1]

    def empty(n, t):
        return (
            torch.zeros(n, t, width, dtype=torch.float64),
            torch.zeros(n, t, samples[0][1].shape[1], dtype=torch.float64),
            torch.zeros(n, t, dtype=torch.long),
            torch.zeros(n, t, dtype=torch.bool),
            torch.zeros(n, t, 20, dtype=torch.float64),
            torch.zeros(n, t, dtype=torch.bool),
        )

    padded = empty(b, longest)
    for j, sample in enumerate(samples):
        n = sample[0].shape[0]
        for dst, src in zip(padded, sample, strict=True):
            dst[j, :n] = src
    packed = empty(len(rows), row_tokens)
    positions = torch.zeros(len(rows), row_tokens, dtype=torch.long)
    segments = torch.zeros(len(rows), row_tokens, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for s, i in enumerate(row, start=1):
            n = samples[i][0].shape[0]
            for dst, src in zip(packed, samples[i], strict=True):
                dst[r, start : start + n] = src
            positions[r, start : start + n] = torch.arange(n)
            segments[r, start : start + n] = s
            start += n
    return padded, (packed, positions, segments)


def test_packed_ttt_equals_padded_ttt():
    drafter, embed = tiny_drafter(seed=3)
    lengths = [9, 5, 12, 7, 3]
    samples = random_samples(lengths, seed=4)
    rows = pack_rows(lengths, 16)
    assert any(len(row) > 1 for row in rows)
    padded, (packed, positions, segments) = padded_and_packed(samples, rows, 16)
    steps, weights = 4, [1.0, 0.8, 0.64, 0.512]
    results, grads = [], []
    for (aux, last, ids, mask, p, in_vocab), extra in (
        (padded, {}),
        (packed, {"positions": positions, "segments": segments}),
    ):
        drafter.zero_grad(set_to_none=True)
        batch = Batch(aux, last, ids, mask, **extra)
        r = ttt_forward(drafter, embed, batch, p, in_vocab, TTTSettings(steps, weights))
        r.loss.backward()
        results.append(r)
        grads.append([q.grad.clone() for q in drafter.parameters()])
    plain, pack = results
    assert plain.step_count == pack.step_count and min(plain.step_count) > 0
    torch.testing.assert_close(pack.loss, plain.loss)
    for k in range(steps):
        assert pack.step_loss[k] == pytest.approx(plain.step_loss[k], rel=1e-9)
        assert pack.step_acc[k] == pytest.approx(plain.step_acc[k], abs=1e-12)
        assert pack.step_cond_acc[k] == pytest.approx(plain.step_cond_acc[k], abs=1e-12)
    accepted = [int((r.accepted * r.counted).sum()) for r in results]
    assert accepted[0] == accepted[1]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_packing_without_boundaries_would_differ():
    """The same packed rows with the boundaries ignored give another loss: the test above
    would catch attention or targets leaking across samples."""
    drafter, embed = tiny_drafter(seed=3)
    torch.manual_seed(5)
    lengths = [6, 6]
    samples = [
        (
            torch.randn(n, 96, dtype=torch.float64),
            torch.zeros(n, 32, dtype=torch.float64),
            torch.randint(0, 50, (n,)),
            torch.ones(n, dtype=torch.bool),
            torch.softmax(3 * torch.randn(n, 20, dtype=torch.float64), -1),
            torch.ones(n, dtype=torch.bool),
        )
        for n in lengths
    ]
    padded, (packed, positions, segments) = padded_and_packed(samples, [[0, 1]], 12)
    aux, last, ids, mask, p, in_vocab = packed
    settings = TTTSettings(3, [1.0, 0.8, 0.64])
    with torch.no_grad():
        packed_batch = Batch(aux, last, ids, mask, positions, segments)
        right = ttt_forward(drafter, embed, packed_batch, p, in_vocab, settings)
        leaky_batch = Batch(aux, last, ids, mask)
        leaky = ttt_forward(drafter, embed, leaky_batch, p, in_vocab, settings)
        aux0, last0, ids0, mask0, p0, v0 = padded
        plain = ttt_forward(drafter, embed, Batch(aux0, last0, ids0, mask0), p0, v0, settings)
    torch.testing.assert_close(right.loss, plain.loss)
    assert not torch.allclose(leaky.loss, plain.loss)


def test_all_padding_rows_change_nothing():
    """An epoch's short last batch is padded to the full row count (one compiled shape):
    the padding rows add nothing to the loss, its metrics or the gradients."""
    drafter, embed = tiny_drafter(seed=5)
    lengths = [9, 5, 12, 7]
    samples = random_samples(lengths, seed=6)
    rows = pack_rows(lengths, 16)
    _, ((aux, last, ids, mask, p, in_vocab), positions, segments) = padded_and_packed(
        samples, rows, 16
    )
    short = Batch(aux, last, ids, mask, positions, segments)
    full = short.padded_to(len(rows) + 3)
    assert full.input_ids.shape[0] == len(rows) + 3 and not full.loss_mask[len(rows) :].any()
    assert short.padded_to(len(rows)) is short
    steps, weights = 3, [1.0, 0.8, 0.64]
    results, grads = [], []
    for batch in (short, full):
        extra = batch.input_ids.shape[0] - len(rows)
        p_rows = torch.cat([p, p.new_zeros(extra, *p.shape[1:])])
        vocab_rows = torch.cat([in_vocab, in_vocab.new_zeros(extra, *in_vocab.shape[1:])])
        drafter.zero_grad(set_to_none=True)
        r = ttt_forward(drafter, embed, batch, p_rows, vocab_rows, TTTSettings(steps, weights))
        r.loss.backward()
        results.append(r)
        grads.append([q.grad.clone() for q in drafter.parameters()])
    torch.testing.assert_close(results[1].loss, results[0].loss)
    assert results[1].step_count == results[0].step_count
    for k in range(steps):
        assert results[1].step_acc[k] == pytest.approx(results[0].step_acc[k], abs=1e-12)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
