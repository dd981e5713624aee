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

    def to(self, device: torch.device, dtype: torch.dtype) -> Batch:
        return Batch(
            self.aux.to(device, dtype),
            self.last.to(device, dtype),
            self.input_ids.to(device),
            self.loss_mask.to(device),
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

    def batch(self, indices: list[int]) -> Batch:
        rows = [
            [self.tensor(i, n) for n in ("aux", "last", "input_ids", "loss_mask")] for i in indices
        ]
        longest = max(r[2].shape[0] for r in rows)
        b = len(rows)
        aux = torch.zeros(b, longest, rows[0][0].shape[1], dtype=rows[0][0].dtype)
        last = torch.zeros(b, longest, rows[0][1].shape[1], dtype=rows[0][1].dtype)
        ids = torch.zeros(b, longest, dtype=torch.long)
        mask = torch.zeros(b, longest, dtype=torch.bool)
        for j, (a, h, x, m) in enumerate(rows):
            n = x.shape[0]
            aux[j, :n], last[j, :n], ids[j, :n], mask[j, :n] = a, h, x.long(), m.bool()
        return Batch(aux, last, ids, mask)
