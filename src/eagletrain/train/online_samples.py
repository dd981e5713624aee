"""Training without an extracted dataset: the target runs inside the training job and its
hidden states are captured (hooks) for each batch, never written to disk. For targets that
fit beside the drafter. It hands the same samples as HiddenSamples to the same batcher, so the
loss and metrics are the offline trainer's."""

from __future__ import annotations

import torch

from eagletrain.data.samples import DataSamples
from eagletrain.runtime.ledger import ItemRow
from eagletrain.target import packed_target_features, target_features
from eagletrain.train.batches import Batch, Sample, pack_tokens


class OnlineSamples:
    """Data-stage samples, their target features computed on demand."""

    def __init__(
        self, samples: DataSamples, items: list[ItemRow], model: torch.nn.Module, aux_ids: list[int]
    ):
        self.source, self.items, self.model, self.aux_ids = samples, items, model, aux_ids
        self.device = next(model.parameters()).device

    def __len__(self) -> int:
        return len(self.items)

    def tokens(self, i: int) -> int:
        return int(self.items[i].tokens or 0)

    def tensor(self, i: int, name: str) -> torch.Tensor:
        ids, mask = self.source.get(self.items[i].key)
        return {"input_ids": ids, "loss_mask": mask}[name]

    def samples(self, indices: list[int]) -> list[Sample]:
        """(aux, last, input_ids, loss_mask) per sample, from one padded target forward."""
        inputs = [self.source.get(self.items[i].key) for i in indices]
        longest = max(len(x) for x, _ in inputs)
        ids = torch.zeros(len(inputs), longest, dtype=torch.long)
        valid = torch.zeros(len(inputs), longest, dtype=torch.bool)
        for b, (x, _) in enumerate(inputs):
            ids[b, : len(x)], valid[b, : len(x)] = x.long(), True
        aux, last = target_features(
            self.model, ids.to(self.device), valid.to(self.device), self.aux_ids
        )
        return [(aux[b, : len(x)], last[b, : len(x)], x, m) for b, (x, m) in enumerate(inputs)]

    def packed_batch(self, rows: list[list[int]], row_tokens: int) -> Batch:
        """Packed rows of these samples, their features from one target forward over the
        rows themselves: row_tokens per row, where a forward over the samples padded to
        the longest would compute every sample at the longest one's length."""
        tokens = pack_tokens(
            [[self.source.get(self.items[i].key) for i in row] for row in rows], row_tokens
        )
        device = self.device
        aux, last = packed_target_features(
            self.model,
            tokens.input_ids.to(device),
            tokens.positions.to(device),  # type: ignore[union-attr]
            self.aux_ids,
        )
        tokens.aux, tokens.last = aux, last
        return tokens
