"""Extraction throughput against the bare target forward, same batches, same dtype.

    .venv/bin/python bench/extract.py [--samples 64] [--max-length 512] [--dtype float32]
                                      [--batch-tokens 8192] [--out DIR] [--repeats 3]

`bare` runs the target's decoder stack over the length-bucketed batches and nothing else;
`full` is eagletrain's extraction loop (forward + hooks + packing + device-to-host copy +
checksums + shard writes + ledger), the same function the extract stage runs. Both are
timed end to end (device synchronised, writer drained), alternating, median of repeats.
Prints a table, then `extract_ratio=<full/bare>` last.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from eagletrain.config import Config
from eagletrain.data.stage import run_data
from eagletrain.extract.shard_writer import ShardWriter
from eagletrain.extract.stage import (
    DataSamples,
    extract_batches,
    forward_captured,
    length_batches,
    resolve_aux_ids,
)
from eagletrain.runtime.rundir import open_run
from eagletrain.target import load_target, pick_device, resolve_target, torch_dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bare_forward(model, batches, samples, device) -> None:
    with torch.inference_mode():
        for batch in batches:
            inputs = [samples.get(i.key)[0] for i in batch]
            longest = max(len(x) for x in inputs)
            ids = torch.zeros(len(inputs), longest, dtype=torch.long)
            valid = torch.zeros(len(inputs), longest, dtype=torch.long)
            for b, x in enumerate(inputs):
                ids[b, : len(x)], valid[b, : len(x)] = x.long(), 1
            model.model(
                input_ids=ids.to(device, non_blocking=True),
                attention_mask=valid.to(device, non_blocking=True),
                use_cache=False,
            )
    sync(device)


def disk_write_bandwidth(directory: Path, total: int, threads: int) -> float:
    """Bytes/s that plain parallel file writes + fsync reach in `directory` (the same volume
    and byte count as the shards): the ceiling any writer of this dataset has there."""
    from concurrent.futures import ThreadPoolExecutor

    block = os.urandom(1 << 24)
    per_file = max(len(block), total // threads)

    def write(i: int) -> None:
        path = directory / f"ceiling-{i}.bin"
        with path.open("wb") as f:
            for _ in range(per_file // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        path.unlink()

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, range(threads)))
    return threads * (per_file // len(block)) * len(block) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--source", default="sharegpt", help="conversations (default: packaged)")
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--store-dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--out", type=Path, default=None, help="where shards go (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--writer-threads", type=int, default=4, help="shards written in parallel")
    args = p.parse_args()

    out = Path(tempfile.mkdtemp(dir=args.out))
    config = Config.model_validate(
        {
            "target": {"model": args.model, "dtype": args.dtype, "device": args.device},
            "data": {
                "source": args.source,
                "limit": args.samples,
                "max_length": args.max_length,
                "samples_per_chunk": 256,
                "heldout_fraction": 0.0,
            },
            "extract": {"store_dtype": args.store_dtype, "batch_tokens": args.batch_tokens},
        }
    )
    run = open_run(config, out / "run")
    run_data(run)
    device = pick_device(args.device)
    model = load_target(resolve_target(config.target), args.dtype, device)
    aux_ids = resolve_aux_ids(run, model.config.num_hidden_layers)
    samples = DataSamples(run)
    items = run.ledger.items("data", "done")
    run.ledger.begin_stage("extract", "items", len(items), "samples")
    run.ledger.plan_items("extract", ((i.key, i.ord, i.split) for i in items))
    planned = run.ledger.items("extract")
    lengths = {k: r.tokens for k, r in samples.rows.items()}
    batches = length_batches(planned, lengths, args.batch_tokens)
    tokens = sum(lengths.values())
    store = torch_dtype(args.store_dtype)

    def full() -> None:
        run.ledger.reset_items("extract", [i.key for i in planned])
        shutil.rmtree(run.dir / "hidden", ignore_errors=True)
        (run.dir / "hidden").mkdir()
        writer = ShardWriter(
            run.dir, "extract", "0/1", "shard-bench", {}, "bench", 64, args.writer_threads
        )
        extract_batches(
            lambda items, inputs: forward_captured(model, items, inputs, aux_ids, store),
            batches,
            samples,
            writer,
        )
        sync(device)

    captured: list = []

    def capture_only() -> None:
        captured.clear()
        for batch in batches:
            inputs = [samples.get(i.key) for i in batch]
            captured.append(forward_captured(model, batch, inputs, aux_ids, store))
        sync(device)

    def write_only() -> None:
        run.ledger.reset_items("extract", [i.key for i in planned])
        writer = ShardWriter(
            run.dir, "extract", "0/1", "shard-bench", {}, "bench", 64, args.writer_threads
        )
        for c in captured:
            writer.put(c)
        writer.close()

    bare_forward(model, batches[:2], samples, device)  # warm-up
    full()
    times: dict[str, list[float]] = {"bare": [], "full": [], "capture": [], "write": []}
    for _ in range(args.repeats):
        for name, fn in (
            ("bare", lambda: bare_forward(model, batches, samples, device)),
            ("capture", capture_only),
            ("write", write_only),
            ("full", full),
        ):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    bare, full_s = statistics.median(times["bare"]), statistics.median(times["full"])
    stored = sum(f.stat().st_size for f in (run.dir / "hidden").glob("*.safetensors"))
    done = run.ledger.counts("extract").get("done", 0)
    assert done == len(planned), f"only {done} of {len(planned)} samples written"
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    disk = disk_write_bandwidth(out, stored, args.writer_threads)
    print(
        f"device {gpu}, compute {args.dtype}, store {args.store_dtype}, out {out}, "
        f"writer threads {args.writer_threads}"
    )
    print(
        f"{'samples':>8} {'tokens':>9} {'batches':>8} {'bare_tok/s':>11} {'full_tok/s':>11} "
        f"{'bytes/tok':>9} {'ratio':>6}"
    )
    print(
        f"{len(planned):>8} {tokens:>9} {len(batches):>8} {tokens / bare:>11.0f} "
        f"{tokens / full_s:>11.0f} {stored / tokens:>9.0f} {bare / full_s:>6.3f}"
    )
    shutil.rmtree(out, ignore_errors=True)
    cap, wri = statistics.median(times["capture"]), statistics.median(times["write"])
    print(
        f"breakdown: capture-only (forward+hooks+pack+D2H) {tokens / cap:.0f} tok/s, "
        f"write-only (checksums+shards+ledger) {tokens / wri:.0f} tok/s"
    )
    print(
        f"disk ceiling: {disk / 1e9:.2f} GB/s written+fsynced by {args.writer_threads} threads "
        f"= {disk / (stored / tokens):.0f} tok/s at {stored / tokens:.0f} bytes/token"
    )
    print(f"extract_ratio={bare / full_s:.3f}")


if __name__ == "__main__":
    main()
