"""The extracted dataset as training reads it: samples by ledger row, lazily from shards."""

from __future__ import annotations

from pathlib import Path

import torch

from eagletrain.extract.codec import FP8, SCALE_SUFFIX, decode_fp8
from eagletrain.runtime.ledger import ItemRow
from eagletrain.runtime.shards import ShardReader, shard_path
from eagletrain.train.batches import Sample


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

    def samples(self, indices: list[int]) -> list[Sample]:
        names = ("aux", "last", "input_ids", "loss_mask")
        return [tuple(self.tensor(i, n) for n in names) for i in indices]
