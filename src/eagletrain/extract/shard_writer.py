"""The extraction writer: background threads that turn captured batches into shards.

The forward loop hands over each batch's valid rows already packed on the device and being
copied into pinned host memory (non-blocking). One collector thread waits for each copy,
checks every sample and cuts a shard once enough samples are buffered; several shard
threads then checksum (hashlib releases the GIL), write and fsync their shards in parallel
and mark the samples done in the ledger, each with its own connection. The queue and the
shards in flight are bounded, so a slow disk slows the GPU down instead of filling host
memory. Shards hold whole batches, so their content does not depend on thread timing.
"""

from __future__ import annotations

import queue
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagletrain.runtime.ledger import ItemRow, Ledger
from eagletrain.runtime.shards import (
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


Buffered = list[tuple[ItemRow, list[torch.Tensor]]]


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
        shard_threads: int = 4,
        hash_threads: int = 8,
        depth: int = 3,
    ):
        self.dir = run_dir / "hidden"
        self.stage, self.partition, self.prefix, self.meta = stage, partition, prefix, meta
        self.worker_id, self.samples_per_shard = worker_id, samples_per_shard
        self._run_dir = run_dir
        self._queue: queue.Queue[CapturedBatch | None] = queue.Queue(maxsize=depth)
        self._hash_pool = ThreadPoolExecutor(max_workers=hash_threads)
        self._shard_pool = ThreadPoolExecutor(max_workers=shard_threads)
        self._in_flight = threading.BoundedSemaphore(shard_threads + 1)
        self._futures: list[Future] = []
        self._local = threading.local()
        self._ledgers: list[Ledger] = []
        self._ledgers_lock = threading.Lock()
        self._buffer: Buffered = []
        self._names = sample_tensor_names([])
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shard-collector", daemon=True)
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
        self._shard_pool.shutdown()
        self._hash_pool.shutdown()
        for ledger in self._ledgers:
            ledger.close()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _ledger(self) -> Ledger:
        """This thread's own connection (a connection must not serve two threads at once)."""
        ledger = getattr(self._local, "ledger", None)
        if ledger is None:
            ledger = self._local.ledger = Ledger(self._run_dir)
            with self._ledgers_lock:
                self._ledgers.append(ledger)
        return ledger

    def _run(self) -> None:
        try:
            while (batch := self._queue.get()) is not None:
                self._take(batch)
                self._check_futures(wait=False)
            self._cut()
            self._check_futures(wait=True)
        except BaseException as err:  # handed to the forward loop, which re-raises it
            self.error = err
            while self._queue.get() is not None:  # unblock the producer until it stops
                pass

    def _check_futures(self, wait: bool) -> None:
        pending = []
        for f in self._futures:
            if wait or f.done():
                f.result()  # re-raises a shard thread's error here
            else:
                pending.append(f)
        self._futures = pending

    def _take(self, batch: CapturedBatch) -> None:
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
            self._ledger().mark_items(self.stage, self.worker_id, failed)
        if len(self._buffer) >= self.samples_per_shard:
            self._cut()

    def _cut(self) -> None:
        """Hand the buffered samples to a shard thread (waiting while too many are in flight)."""
        if not self._buffer:
            return
        buffered, self._buffer = self._buffer, []
        self._in_flight.acquire()
        future = self._shard_pool.submit(self._write, buffered, self._names)
        future.add_done_callback(lambda _: self._in_flight.release())
        self._futures.append(future)

    def _write(self, buffered: Buffered, names: tuple[str, ...]) -> None:
        ledger = self._ledger()
        name = f"{self.prefix}-{buffered[0][0].ord:08d}-{uuid.uuid4().hex[:6]}.safetensors"
        checksums = list(self._hash_pool.map(lambda entry: sample_checksum(entry[1]), buffered))
        index, results, offset = [], [], 0
        for (item, rows), checksum in zip(buffered, checksums, strict=True):
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
            name_: torch.cat([rows[j] for _, rows in buffered]) for j, name_ in enumerate(names)
        }
        ledger.begin_shard(self.stage, name, self.partition)
        size = write_shard(shard_path(self.dir, name), stacked, index, self.meta)
        for r in results:
            r["bytes"] = size * r["tokens"] // offset
        ledger.mark_items(self.stage, self.worker_id, results, (name, size))
