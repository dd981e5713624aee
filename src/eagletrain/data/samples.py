"""Reading the data stage's samples: token ids and loss masks from their chunks, by key."""

from __future__ import annotations

import torch

from eagletrain.runtime.rundir import Run
from eagletrain.runtime.shards import ShardReader, shard_path


class DataSamples:
    """Token ids and loss masks of data-stage samples, read from their chunks on demand."""

    def __init__(self, run: Run):
        self.dir = run.dir / "data"
        self.rows = {i.key: i for i in run.ledger.items("data", "done")}
        self._readers: dict[str, ShardReader] = {}

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[key]
        reader = self._readers.get(row.shard)
        if reader is None:
            reader = self._readers[row.shard] = ShardReader(shard_path(self.dir, row.shard))
        return (
            reader.rows("input_ids", row.offset, row.tokens),
            reader.rows("loss_mask", row.offset, row.tokens),
        )
