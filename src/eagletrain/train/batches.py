"""Training batches: one padded sample per row, or samples packed into rows of a fixed
length (fewer padding tokens per step, and one sequence length for the kernels). A
`Batcher` decides the rows once per dataset; HiddenSamples and OnlineSamples only hand it
samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from eagletrain.errors import ConfigError
from eagletrain.train.packing import SampleTooLong, pack_rows

# (aux [T, 3H], last [T, H], input_ids [T], loss_mask [T]) of one sample
Sample = tuple[torch.Tensor, ...]


class Samples(Protocol):
    """What a batcher needs of a dataset: its size, each sample's token count, and samples."""

    items: list

    def __len__(self) -> int: ...

    def tokens(self, i: int) -> int: ...

    def samples(self, indices: list[int]) -> list[Sample]: ...


@runtime_checkable
class PackedFeatures(Protocol):
    """A dataset that computes features for whole packed rows at once (online training:
    one target forward over the rows, not one over samples padded to the longest)."""

    def packed_batch(self, rows: list[list[int]], row_tokens: int) -> Batch: ...


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, 3H]
    last: torch.Tensor  # [B, T, H]
    input_ids: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    # packed rows only: rope position within the sample, and the sample's number in its
    # row (1, 2, ...; 0 on padding)
    positions: torch.Tensor | None = None
    segments: torch.Tensor | None = None

    def padded_to(self, rows: int) -> Batch:
        """This batch with all-padding rows appended up to `rows` (no loss, no figure
        changes): an epoch's short last batch keeps the shape compiled kernels were built for."""
        extra = rows - self.input_ids.shape[0]
        if extra <= 0:
            return self

        def grow(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return torch.cat([t, t.new_zeros((extra, *t.shape[1:]))])

        return Batch(
            grow(self.aux),
            grow(self.last),
            grow(self.input_ids),
            grow(self.loss_mask),
            grow(self.positions),
            grow(self.segments),
        )

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Batch(
            self.aux.to(device, dtype),
            self.last.to(device, dtype),
            self.input_ids.to(device),
            self.loss_mask.to(device),
            move(self.positions),
            move(self.segments),
        )


def _empty_batch(like: Sample, b: int, t: int, packed: bool) -> Batch:
    aux, last = like[0], like[1]
    return Batch(
        aux.new_zeros(b, t, aux.shape[-1]),
        last.new_zeros(b, t, last.shape[-1]),
        torch.zeros(b, t, dtype=torch.long),
        torch.zeros(b, t, dtype=torch.bool),
        torch.zeros(b, t, dtype=torch.long) if packed else None,
        torch.zeros(b, t, dtype=torch.long) if packed else None,
    )


def pad_batch(samples: list[Sample]) -> Batch:
    """One sample per row, right-padded to the longest."""
    out = _empty_batch(samples[0], len(samples), max(s[2].shape[0] for s in samples), False)
    for b, (aux, last, ids, mask) in enumerate(samples):
        n = ids.shape[0]
        out.aux[b, :n], out.last[b, :n] = aux, last
        out.input_ids[b, :n], out.loss_mask[b, :n] = ids.long(), mask.bool()
    return out


def pack_batch(rows: list[list[Sample]], row_tokens: int) -> Batch:
    """Each row holds its samples one after another, padded to row_tokens; positions restart
    at each sample and segments number them (1, 2, ...; 0 on padding)."""
    out = _empty_batch(rows[0][0], len(rows), row_tokens, True)
    for r, row in enumerate(rows):
        start = 0
        for aux, last, ids, _ in row:
            end = start + ids.shape[0]
            out.aux[r, start:end], out.last[r, start:end] = aux, last
            start = end
    _fill_packed_tokens(out, [[(s[2], s[3]) for s in row] for row in rows])
    return out


def pack_tokens(rows: list[list[tuple[torch.Tensor, torch.Tensor]]], row_tokens: int) -> Batch:
    """Packed rows of (input_ids, loss_mask) samples, with empty (0-width) features: for
    a caller that computes the features from the packed rows themselves (online)."""
    b = len(rows)
    out = Batch(
        torch.zeros(b, row_tokens, 0),
        torch.zeros(b, row_tokens, 0),
        torch.zeros(b, row_tokens, dtype=torch.long),
        torch.zeros(b, row_tokens, dtype=torch.bool),
        torch.zeros(b, row_tokens, dtype=torch.long),
        torch.zeros(b, row_tokens, dtype=torch.long),
    )
    _fill_packed_tokens(out, rows)
    return out


def _fill_packed_tokens(out: Batch, rows: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> None:
    assert out.positions is not None and out.segments is not None
    for r, row in enumerate(rows):
        start = 0
        for s, (ids, mask) in enumerate(row, start=1):
            end = start + ids.shape[0]
            out.input_ids[r, start:end], out.loss_mask[r, start:end] = ids.long(), mask.bool()
            out.positions[r, start:end] = torch.arange(end - start)
            out.segments[r, start:end] = s
            start = end


def packed_rows(data: Samples, row_tokens: int) -> list[list[int]]:
    """The samples' indices packed into rows of at most `row_tokens` tokens; a sample
    longer than a row is a ConfigError naming it."""
    try:
        return pack_rows([data.tokens(i) for i in range(len(data))], row_tokens)
    except SampleTooLong as err:
        raise ConfigError(
            f"train.pack_length {row_tokens} is shorter than sample {data.items[err.index].key} "
            f"({err.tokens} tokens); set it to at least data.max_length"
        ) from None


class Batcher:
    """A dataset's units (samples, or packed rows of samples: `rows` is decided here, once)
    and the batch of any list of units."""

    def __init__(self, data: Samples, pack_length: int | None):
        self.data, self.pack_length = data, pack_length
        self.rows = packed_rows(data, pack_length) if pack_length else None

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.data)

    def batch(self, units: list[int]) -> Batch:
        if self.rows is None or self.pack_length is None:
            return pad_batch(self.data.samples(units))
        rows = [self.rows[u] for u in units]
        if isinstance(self.data, PackedFeatures):
            return self.data.packed_batch(rows, self.pack_length)
        flat = [i for row in rows for i in row]
        by_index = dict(zip(flat, self.data.samples(flat), strict=True))
        return pack_batch([[by_index[i] for i in row] for row in rows], self.pack_length)
