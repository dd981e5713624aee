"""The extraction writer: a background thread that turns captured batches into shards.

The forward loop hands over each batch's valid rows already packed on the device and being
copied into pinned host memory (non-blocking); this thread waits for that copy, checks and
checksums every sample (hashing in a thread pool: hashlib releases the GIL), writes a shard
atomically once enough samples are buffered, and marks them done in the ledger. The queue
is bounded, so a slow disk slows the GPU down instead of filling host memory.
"""

from __future__ import annotations

import queue
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagletrain.ledger import ItemRow, Ledger
from eagletrain.shards import (
    IndexEntry,
    sample_checksum,
    sample_tensor_names,
    shard_path,
    write_shard,
)


@dataclass
class CapturedBatch:
    items: list[ItemRow]
    lengths: list[int]
    aux: torch.Tensor  # [N, 3H] host (pinned when the model is on a GPU), store dtype
    last: torch.Tensor  # [N, H]
    finite: torch.Tensor  # [B] bool: every captured value of the sample is finite
    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    ready: torch.cuda.Event | None  # set when the device-to-host copy has landed
    # float8 storage: per-token scales of "aux" and "last" ([N, layers] float32)
    scales: dict[str, torch.Tensor] = field(default_factory=dict)


class ShardWriter:
    def __init__(
        self,
        run_dir: Path,
        stage: str,
        partition: str,
        prefix: str,
        meta: dict[str, Any],
        worker_id: str,
        samples_per_shard: int,
        hash_threads: int = 8,
        depth: int = 3,
    ):
        self.dir = run_dir / "hidden"
        self.stage, self.partition, self.prefix, self.meta = stage, partition, prefix, meta
        self.worker_id, self.samples_per_shard = worker_id, samples_per_shard
        self._run_dir = run_dir
        self._queue: queue.Queue[CapturedBatch | None] = queue.Queue(maxsize=depth)
        self._pool = ThreadPoolExecutor(max_workers=hash_threads)
        self._buffer: list[tuple[ItemRow, list[torch.Tensor]]] = []
        self._names = sample_tensor_names([])
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shard-writer", daemon=True)
        self._thread.start()

    def put(self, batch: CapturedBatch) -> None:
        self._raise_if_failed()
        while True:
            try:
                self._queue.put(batch, timeout=0.5)
                return
            except queue.Full:
                self._raise_if_failed()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._pool.shutdown()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        ledger = Ledger(self._run_dir)
        try:
            while (batch := self._queue.get()) is not None:
                self._take(ledger, batch)
            self._flush(ledger)
        except BaseException as err:  # handed to the forward loop, which re-raises it
            self.error = err
            while self._queue.get() is not None:  # unblock the producer until it stops
                pass
        finally:
            ledger.close()

    def _take(self, ledger: Ledger, batch: CapturedBatch) -> None:
        if batch.ready is not None:
            batch.ready.synchronize()
        failed, offset = [], 0
        self._names = sample_tensor_names(batch.scales)
        finite = batch.finite.tolist()
        for j, item in enumerate(batch.items):
            n = batch.lengths[j]
            if not finite[j]:
                failed.append(
                    {
                        "key": item.key,
                        "state": "failed",
                        "error": "non-finite hidden state (NaN/Inf)",
                    }
                )
            else:
                rows = [
                    batch.aux[offset : offset + n],
                    batch.last[offset : offset + n],
                    batch.input_ids[j],
                    batch.loss_mask[j],
                    *(s[offset : offset + n] for s in batch.scales.values()),
                ]
                self._buffer.append((item, rows))
            offset += n
        if failed:
            ledger.mark_items(self.stage, self.worker_id, failed)
        if len(self._buffer) >= self.samples_per_shard:
            self._flush(ledger)

    def _flush(self, ledger: Ledger) -> None:
        if not self._buffer:
            return
        name = f"{self.prefix}-{self._buffer[0][0].ord:08d}-{uuid.uuid4().hex[:6]}.safetensors"
        checksums = list(self._pool.map(lambda entry: sample_checksum(entry[1]), self._buffer))
        index, results, offset = [], [], 0
        for (item, rows), checksum in zip(self._buffer, checksums, strict=True):
            n = rows[0].shape[0]
            index.append(IndexEntry(item.key, offset, n, checksum))
            results.append(
                {
                    "key": item.key,
                    "state": "done",
                    "tokens": n,
                    "checksum": checksum,
                    "shard": name,
                    "offset": offset,
                }
            )
            offset += n
        stacked = {
            name_: torch.cat([rows[j] for _, rows in self._buffer])
            for j, name_ in enumerate(self._names)
        }
        ledger.begin_shard(self.stage, name, self.partition)
        size = write_shard(shard_path(self.dir, name), stacked, index, self.meta)
        for r in results:
            r["bytes"] = size * r["tokens"] // offset
        ledger.mark_items(self.stage, self.worker_id, results, (name, size))
        self._buffer.clear()
