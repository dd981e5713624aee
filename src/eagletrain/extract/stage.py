"""Stage 2, extract: run the target over every sample and keep what EAGLE-3 trains on.

Per sample: `aux` = concat of the three aux layers' outputs [T, 3H], `last` = the last
decoder layer's output before the final norm [T, H], and the sample's token ids and loss
mask (so a shard is self-describing). Samples are batched by length, written into
safetensors shards, and marked done only after their shard is durable.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from eagletrain.data.samples import DataSamples
from eagletrain.errors import DiskSpaceError, InputError
from eagletrain.extract.codec import FP8, to_store_dtype
from eagletrain.extract.metadata import DATASET_META, dataset_metadata, resolve_aux_ids
from eagletrain.extract.shard_writer import CapturedBatch, ShardWriter
from eagletrain.runtime.faults import inject_delay
from eagletrain.runtime.ledger import ItemRow
from eagletrain.runtime.progress import stage_progress
from eagletrain.runtime.rundir import Run, require_data_target, require_previous
from eagletrain.runtime.shards import (
    remove_unfinished,
    shard_path,
)
from eagletrain.runtime.verify import finalize_items_stage, verify_stage
from eagletrain.runtime.worker import WorkerSession
from eagletrain.target import (
    capture_layer_outputs,
    load_target,
    load_tokenizer,
    pick_device,
    resolve_target,
    template_hash,
    torch_dtype,
)

STAGE = "extract"


def length_batches(
    items: list[ItemRow], lengths: dict[str, int], batch_tokens: int
) -> list[list[ItemRow]]:
    """Group samples of similar length so padding stays small: longest first, and a batch's
    padded size (longest x count) never exceeds batch_tokens (a longer sample goes alone)."""
    ordered = sorted(items, key=lambda i: (-lengths[i.key], i.ord))
    batches: list[list[ItemRow]] = []
    for item in ordered:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0].key] <= batch_tokens:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


def partition_batches(
    planned: list[ItemRow],
    lengths: dict[str, int],
    batch_tokens: int,
    partition: tuple[int, int],
) -> list[list[ItemRow]]:
    """This worker's pending batches. Batches are formed over *all* planned samples and then
    dealt to partitions (batch j to partition j % N), and finished batches are skipped; shards
    are cut only between batches. So every sample is computed in the same batch (same shapes)
    whether one worker or N do the work, and whether or not a run was killed and resumed:
    the hidden states are bit-identical. Samples reset on their own (--repair) are batched
    among themselves, by sample order."""
    index, count = partition
    whole = [
        (j, b)
        for j, b in enumerate(length_batches(planned, lengths, batch_tokens))
        if all(i.state == "pending" for i in b)
    ]
    mine = [b for j, b in whole if j % count == index]
    in_whole = {i.key for _, b in whole for i in b}
    leftovers = [
        i
        for i in planned
        if i.state == "pending" and i.key not in in_whole and i.ord % count == index
    ]
    return mine + length_batches(leftovers, lengths, batch_tokens)


def forward_captured(
    model: torch.nn.Module,
    items: list[ItemRow],
    inputs: list[tuple[torch.Tensor, torch.Tensor]],
    aux_ids: list[int],
    store_dtype: torch.dtype,
) -> CapturedBatch:
    """Right-padded batched forward. Only the valid rows of the captured layers leave the
    device: gathered there, cast to the storage dtype, copied to pinned host memory without
    blocking (the writer thread waits on the returned event). Nothing here waits for the
    device, so the next batch is queued while this one computes: the valid rows are
    gathered by indices built on the host, not by a boolean mask (whose size the host
    would have to wait for)."""
    device = next(model.parameters()).device
    on_gpu = device.type == "cuda"
    last_id = model.config.num_hidden_layers - 1
    lengths = [len(ids) for ids, _ in inputs]
    longest = max(lengths)
    ids = torch.zeros(len(inputs), longest, dtype=torch.long, pin_memory=on_gpu)
    valid = torch.zeros(len(inputs), longest, dtype=torch.long, pin_memory=on_gpu)
    for b, (x, _) in enumerate(inputs):
        ids[b, : len(x)] = x.long()
        valid[b, : len(x)] = 1
    rows = torch.cat([torch.arange(n) + b * longest for b, n in enumerate(lengths)])
    sample_of_row = torch.repeat_interleave(torch.arange(len(inputs)), torch.tensor(lengths))
    if on_gpu:
        rows, sample_of_row = rows.pin_memory(), sample_of_row.pin_memory()
    ids, valid, rows, sample_of_row = (
        t.to(device, non_blocking=True) for t in (ids, valid, rows, sample_of_row)
    )
    with torch.inference_mode(), capture_layer_outputs(model, [*aux_ids, last_id]) as captured:
        model.model(input_ids=ids, attention_mask=valid, use_cache=False)
        aux = torch.cat([captured[i].flatten(0, 1).index_select(0, rows) for i in aux_ids], -1)
        last = captured[last_id].flatten(0, 1).index_select(0, rows)
        row_ok = torch.isfinite(aux).all(-1) & torch.isfinite(last).all(-1)
        bad_rows = torch.zeros(len(inputs), dtype=torch.int32, device=device)
        finite = bad_rows.index_add_(0, sample_of_row, (~row_ok).int()) == 0
        # on the device: float8 halves the bytes that cross the bus
        aux, last, scales = to_store_dtype(aux, last, len(aux_ids), store_dtype)
        on_device = [aux, last, finite, *scales.values()]
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu) for t in on_device]
        for h, t in zip(host, on_device, strict=True):
            h.copy_(t, non_blocking=on_gpu)
        ready = None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()
    return CapturedBatch(
        items,
        lengths,
        host[0],
        host[1],
        host[2],
        [x for x, _ in inputs],
        [m for _, m in inputs],
        ready,
        dict(zip(scales, host[3:], strict=True)),
    )


# (samples of a batch, their (input_ids, loss_mask)) -> their captured hidden states
Capture = Callable[[list[ItemRow], list[tuple[torch.Tensor, torch.Tensor]]], CapturedBatch]


def extract_batches(
    capture: Capture,
    batches: list[list[ItemRow]],
    samples: DataSamples,
    writer: ShardWriter,
    on_batch: Callable[[list[ItemRow]], None] = lambda batch: None,
) -> None:
    """The extraction loop proper (the benchmark times exactly this)."""
    for batch in batches:
        inputs = [samples.get(i.key) for i in batch]
        writer.put(capture(batch, inputs))
        on_batch(batch)
    writer.close()


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")  # partition workers write it together
    tmp.write_text(json.dumps(obj, indent=2))
    os.replace(tmp, path)


def check_space(run: Run, hidden: int, store_dtype: torch.dtype, tokens: int) -> None:
    """Print the size estimate, and refuse to start when it cannot fit the free disk."""
    per_token = 4 * hidden * torch.finfo(store_dtype).bits // 8 + 5  # aux+last, ids, mask
    if store_dtype == FP8:
        per_token += 4 * 4  # a float32 scale per captured layer
    needed = per_token * tokens
    free = shutil.disk_usage(run.dir / "hidden").free
    print(
        f"extract: {tokens:,} tokens x {per_token:,} bytes/token = {needed / 1e9:.2f} GB; "
        f"{free / 1e9:.2f} GB free at {run.dir / 'hidden'}"
    )
    if run.config.extract.check_space and needed > free:
        raise DiskSpaceError(
            f"extract needs ~{needed / 1e9:.2f} GB for {tokens:,} tokens but "
            f"{run.dir / 'hidden'} has {free / 1e9:.2f} GB free; free space or set "
            f"extract.check_space=false"
        )


def repair(run: Run) -> list[str]:
    """Reset every sample that verification finds bad to pending; returns their keys."""
    report = verify_stage(run.dir, run.ledger, STAGE, deep=True)
    keys = [key for key, _ in report.bad]
    if keys:
        run.ledger.revoke_completion(STAGE)
        run.ledger.reset_items(STAGE, keys)
    return keys


def drop_unreferenced_shards(run: Run) -> None:
    """Delete shards none of whose samples the ledger still points to (after a repair)."""
    referenced = run.ledger.referenced_shards(STAGE)
    cur = run.ledger.conn.execute(
        "SELECT name FROM shards WHERE stage=? AND state='done'", (STAGE,)
    )
    stale = [name for (name,) in cur if name not in referenced]
    for name in stale:
        shard_path(run.dir / "hidden", name).unlink(missing_ok=True)
    run.ledger.forget_shards(STAGE, stale)


def run_extract(
    run: Run,
    partition: tuple[int, int] = (0, 1),
    allow_partial: bool = False,
    repair_bad: bool = False,
) -> list[str]:
    """Extract every pending sample of the partition; with repair_bad, first reset the
    samples verification finds bad. Returns the repaired keys."""
    ledger, cfg = run.ledger, run.config
    repaired = repair(run) if repair_bad else []
    if ledger.completion(STAGE) is not None:
        return repaired
    require_previous(run, STAGE, allow_partial)
    source = resolve_target(cfg.target)
    require_data_target(run, source.identity)
    tmpl = template_hash(load_tokenizer(source))
    data_detail = (ledger.stage_row("data") or {}).get("detail", {})
    if data_detail.get("template_hash") not in (None, tmpl):
        raise InputError(
            f"chat template of {source.directory} (hash {tmpl}) differs from the one the data "
            f"was tokenized with ({data_detail['template_hash']})"
        )
    samples = DataSamples(run)
    data_items = ledger.items("data", "done")
    ledger.begin_stage(STAGE, "items", len(data_items), "samples")
    ledger.plan_items(STAGE, ((i.key, i.ord, i.split) for i in data_items))

    engine = cfg.extract.backend == "engine"
    if engine:  # the target's config only: its weights stay with the engine
        from transformers import AutoConfig

        target_config = AutoConfig.from_pretrained(source.directory)
    else:
        model = load_target(source, cfg.target.dtype, pick_device(cfg.target.device))
        target_config = model.config
    aux_ids = resolve_aux_ids(run, target_config.num_hidden_layers)
    meta = dataset_metadata(run, target_config, source.identity, tmpl, aux_ids)
    directory = run.dir / "hidden"
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(directory / DATASET_META, meta)
    ledger.update_detail(STAGE, **meta)
    store_dtype = torch_dtype(cfg.extract.store_dtype)
    part = f"{partition[0]}/{partition[1]}"
    prefix = f"shard-p{partition[0]}of{partition[1]}"

    def done_count(led) -> int:
        return led.counts(STAGE).get("done", 0)

    missing = 0
    with WorkerSession(ledger, run.dir, STAGE, part, done_counter=done_count) as worker:
        unfinished = ledger.unfinished_shards(STAGE, part)
        remove_unfinished(directory, unfinished)
        ledger.forget_shards(STAGE, unfinished)
        batches = partition_batches(
            ledger.items(STAGE),
            {k: r.tokens for k, r in samples.rows.items()},
            cfg.extract.batch_tokens,
            partition,
        )
        if engine:
            capture, batches, missing = engine_capture(
                run, source, target_config, aux_ids, store_dtype, batches, samples
            )
        else:

            def capture(items, inputs):
                return forward_captured(model, items, inputs, aux_ids, store_dtype)

        pending = [i for b in batches for i in b]
        tokens = sum(samples.rows[i.key].tokens for i in pending)
        check_space(run, target_config.hidden_size, store_dtype, tokens)
        writer = ShardWriter(
            run.dir,
            STAGE,
            part,
            prefix,
            meta,
            worker.id,
            cfg.extract.samples_per_shard,
            cfg.extract.writer_threads,
        )

        with stage_progress() as bar:
            task = bar.add_task("extract", total=len(pending), unit="samples")

            def on_batch(batch: list[ItemRow]) -> None:
                worker.set_current(f"batch from sample {batch[0].key}")
                bar.advance(task, len(batch))
                inject_delay("extract")

            extract_batches(capture, batches, samples, writer, on_batch)
        worker.sample_now()
    drop_unreferenced_shards(run)
    if missing:
        print(
            f"extract: {missing} samples of partition {part} have no engine dump in "
            f"{cfg.extract.engine.dump_dir} yet; rerun when the engine has written them"
        )
    finalize_items_stage(run.dir, ledger, STAGE, {"aux_layer_ids": aux_ids})
    return repaired


def engine_capture(
    run: Run,
    source: Any,
    target_config: Any,
    aux_ids: list[int],
    store_dtype: torch.dtype,
    batches: list[list[ItemRow]],
    samples: DataSamples,
) -> tuple[Capture, list[list[ItemRow]], int]:
    """(capture from engine dumps, the batches cut to samples that have one, how many do
    not). With extract.engine.base_url, the samples without a dump are requested first."""
    from eagletrain.extract.engine_ingest import EngineDumps, request_dumps, serve_command

    cfg = run.config.extract.engine
    layers, hidden = target_config.num_hidden_layers, target_config.hidden_size
    dumps = EngineDumps(cfg, aux_ids, layers, hidden)
    dumps.scan()
    ids = {i.key: samples.get(i.key)[0] for b in batches for i in b}
    found = {key: dumps.find(x) for key, x in ids.items()}
    absent = [key for key, dump in found.items() if dump is None]
    if absent and cfg.base_url:
        failed = request_dumps(cfg, [(key, ids[key]) for key in absent])
        if failed:
            print(f"extract: {len(failed)} engine requests failed; rerun to retry them")
        dumps.scan()
        found.update({key: dumps.find(ids[key]) for key in absent})
    elif absent and not dumps.by_hash:
        print(
            "extract: no engine dumps yet; a vLLM server that writes them: "
            + serve_command(
                str(source.directory),
                str(dumps.dir),
                aux_ids,
                layers,
                run.config.data.max_length + 1,
            )
        )
    kept = [[i for i in b if found[i.key] is not None] for b in batches]
    missing = sum(1 for dump in found.values() if dump is None)
    if dumps.in_progress:
        print(
            f"extract: {dumps.in_progress} engine dumps are still being written (the engine "
            f"holds their .lock); a later run takes them"
        )

    def capture(items, inputs):
        return dumps.captured(items, inputs, [found[i.key] for i in items], store_dtype)

    return capture, [b for b in kept if b], missing
