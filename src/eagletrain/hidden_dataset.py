"""Reading the extracted dataset for training: samples by ledger row, padded batches."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagletrain.hidden_codec import FP8, SCALE_SUFFIX, decode_fp8
from eagletrain.ledger import ItemRow
from eagletrain.shards import ShardReader, shard_path


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


class HiddenSamples:
    """The done samples of the extract stage, read lazily from their shards."""

    def __init__(self, hidden_dir: Path, items: list[ItemRow]):
        self.dir = hidden_dir
        self.items = items
        self._readers: dict[str, ShardReader] = {}

    def __len__(self) -> int:
        return len(self.items)

    def _reader(self, shard: str) -> ShardReader:
        if shard not in self._readers:
            self._readers[shard] = ShardReader(shard_path(self.dir, shard))
        return self._readers[shard]

    def tensor(self, i: int, name: str) -> torch.Tensor:
        """A sample's rows of one tensor; float8-stored states come back decoded (float32)."""
        item = self.items[i]
        reader = self._reader(item.shard)
        rows = reader.rows(name, item.offset, item.tokens)
        if rows.dtype == FP8:
            scale = reader.rows(f"{name}{SCALE_SUFFIX}", item.offset, item.tokens)
            return decode_fp8(rows, scale)
        return rows

    def tokens(self, i: int) -> int:
        return int(self.items[i].tokens or 0)

    def sample(self, i: int) -> Sample:
        return tuple(self.tensor(i, n) for n in ("aux", "last", "input_ids", "loss_mask"))

    def batch(self, indices: list[int]) -> Batch:
        return pad_batch([self.sample(i) for i in indices])

    def packed_batch(self, rows: list[list[int]], row_tokens: int) -> Batch:
        return pack_batch([[self.sample(i) for i in row] for row in rows], row_tokens)


# (aux [T, 3H], last [T, H], input_ids [T], loss_mask [T]) of one sample
Sample = tuple[torch.Tensor, ...]


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
        for s, (aux, last, ids, mask) in enumerate(row, start=1):
            end = start + ids.shape[0]
            out.aux[r, start:end], out.last[r, start:end] = aux, last
            out.input_ids[r, start:end], out.loss_mask[r, start:end] = ids.long(), mask.bool()
            out.positions[r, start:end] = torch.arange(end - start)
            out.segments[r, start:end] = s
            start = end
    return out
