"""Stage 1, data: conversations -> chat template -> token ids + assistant-only loss mask.

Each conversation is a ledger item keyed by its content. Tokenized samples are written in
chunks (safetensors) and marked done after the chunk is durable.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import torch

from eagletrain.chat_tokenize import tokenize_conversation
from eagletrain.conversations import Record, read_records
from eagletrain.faults import inject_delay
from eagletrain.progress import stage_progress
from eagletrain.rundir import Run
from eagletrain.shards import IndexEntry, remove_unfinished, sample_checksum, write_shard
from eagletrain.target import load_tokenizer, resolve_target, template_hash
from eagletrain.verify import finalize_items_stage
from eagletrain.worker import WorkerSession

STAGE = "data"


def planned_records(run: Run) -> tuple[list[Record], int]:
    """The run's input in its deterministic order (shuffled by seed, limited), de-duplicated."""
    cfg = run.config.data
    records = list(read_records(cfg.source, cfg.format, cfg.on_malformed))
    random.Random(cfg.shuffle_seed).shuffle(records)
    if cfg.limit is not None:
        records = records[: cfg.limit]
    unique: dict[str, Record] = {}
    for record in records:
        unique.setdefault(record.key, record)
    return list(unique.values()), len(records) - len(unique)


def split_of(key: str, heldout_fraction: float) -> str:
    return "heldout" if int(key[:8], 16) / 2**32 < heldout_fraction else "train"


def _tokenize(
    run: Run, tokenizer: Any, record: Record
) -> tuple[dict[str, Any], torch.Tensor | None, torch.Tensor | None]:
    """A ledger result for one record, and its tensors when it is kept."""
    if record.rejected:
        return {"key": record.key, "state": "skipped", "error": record.rejected}, None, None
    cfg = run.config.data
    try:
        sample = tokenize_conversation(tokenizer, record.messages)
    except Exception as err:  # template errors (e.g. roles it refuses) are per-sample skips
        reason = f"chat template: {str(err).splitlines()[0][:80]}"
        return {"key": record.key, "state": "skipped", "error": reason}, None, None
    ids, mask = sample.input_ids, sample.loss_mask
    if len(ids) > cfg.max_length:
        if cfg.overlength == "drop":
            return {"key": record.key, "state": "skipped", "error": "over max_length"}, None, None
        ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
    if int(mask.sum()) == 0:
        return (
            {
                "key": record.key,
                "state": "skipped",
                "error": "no assistant tokens within max_length",
            },
            None,
            None,
        )
    return {"key": record.key, "state": "done", "tokens": len(ids)}, ids, mask


def run_data(run: Run, partition: tuple[int, int] = (0, 1)) -> None:
    ledger, cfg = run.ledger, run.config
    if ledger.completion(STAGE) is not None:
        return
    source = resolve_target(cfg.target)
    tokenizer = load_tokenizer(source)
    records, duplicates = planned_records(run)
    ledger.begin_stage(STAGE, "items", len(records), "samples")
    ledger.plan_items(
        STAGE,
        ((r.key, i, split_of(r.key, cfg.data.heldout_fraction)) for i, r in enumerate(records)),
    )
    metadata = {
        "target": source.identity,
        "template_hash": template_hash(tokenizer),
        "source": cfg.data.source,
        "duplicates_dropped": duplicates,
    }
    ledger.update_detail(STAGE, **metadata)
    by_key = {r.key: r for r in records}
    part = f"{partition[0]}/{partition[1]}"
    prefix = f"chunk-p{partition[0]}of{partition[1]}"
    directory = run.dir / "data"
    directory.mkdir(parents=True, exist_ok=True)

    def done_count(led) -> int:
        counts = led.counts(STAGE)
        return counts.get("done", 0) + counts.get("skipped", 0)

    with WorkerSession(ledger, run.dir, STAGE, part, done_counter=done_count) as worker:
        unfinished = ledger.unfinished_shards(STAGE, part)
        remove_unfinished(directory, unfinished)
        ledger.forget_shards(STAGE, unfinished)
        pending = ledger.items(STAGE, "pending", partition)
        step = cfg.data.samples_per_chunk
        with stage_progress() as bar:
            task = bar.add_task("data", total=len(pending), unit="samples")
            for start in range(0, len(pending), step):
                chunk = pending[start : start + step]
                results, ids_list, mask_list, index = [], [], [], []
                offset = 0
                for item in chunk:
                    result, ids, mask = _tokenize(run, tokenizer, by_key[item.key])
                    if ids is not None:
                        result["checksum"] = sample_checksum([ids, mask])
                        result["offset"] = offset
                        index.append(IndexEntry(item.key, offset, len(ids), result["checksum"]))
                        ids_list.append(ids)
                        mask_list.append(mask)
                        offset += len(ids)
                    results.append(result)
                shard = None
                if index:
                    name = f"{prefix}-{chunk[0].ord:08d}-{uuid.uuid4().hex[:6]}.safetensors"
                    ledger.begin_shard(STAGE, name, part)
                    size = write_shard(
                        directory / name,
                        {"input_ids": torch.cat(ids_list), "loss_mask": torch.cat(mask_list)},
                        index,
                        metadata,
                    )
                    shard = (name, size)
                    for r in results:
                        if r["state"] == "done":
                            r["shard"] = name
                ledger.mark_items(STAGE, worker.id, results, shard)
                bar.advance(task, len(chunk))
                inject_delay("data")
        worker.sample_now()
    finalize_items_stage(run.dir, ledger, STAGE, metadata)
