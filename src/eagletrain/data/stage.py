"""Stage 1, data: conversations -> chat template -> token ids + assistant-only loss mask.

Each conversation is a ledger item keyed by its content. Tokenized samples are written in
chunks (safetensors) and marked done after the chunk is durable.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

from eagletrain.data.chat_tokenize import tokenize_conversation
from eagletrain.data.conversations import Record, read_records
from eagletrain.data.samples import DataSamples
from eagletrain.data.self_prompts import api_writer, local_writer, write_prompts
from eagletrain.data.token_coverage import count_tokens, coverage_curve
from eagletrain.errors import InputError
from eagletrain.runtime.faults import inject_delay
from eagletrain.runtime.progress import stage_progress
from eagletrain.runtime.rundir import Run
from eagletrain.runtime.shards import IndexEntry, remove_unfinished, sample_checksum, write_shard
from eagletrain.runtime.stop_request import StopRequest
from eagletrain.runtime.verify import finalize_items_stage
from eagletrain.runtime.worker import WorkerSession
from eagletrain.target import (
    load_target,
    load_tokenizer,
    pick_device,
    resolve_target,
    target_eos,
    template_hash,
)

STAGE = "data"
SELF_SOURCE = "self"
EMPTY_REPLY = {"role": "assistant", "content": ""}  # a turn the target will write


def _source_records(run: Run, source: str) -> list[Record]:
    """One source's records: a file's, shuffled by seed and limited; or the prompts the
    target wrote (each a user turn awaiting the target's reply)."""
    cfg = run.config.data
    if source == SELF_SOURCE:
        return [
            Record(f"self:{slot}", [{"role": "user", "content": text}, EMPTY_REPLY])
            for slot, text in run.ledger.kept_prompts()
        ]
    records = list(read_records(source, cfg.format, cfg.on_malformed))
    random.Random(cfg.shuffle_seed).shuffle(records)
    return records if cfg.limit is None else records[: cfg.limit]


def planned_records(run: Run) -> tuple[list[Record], int, dict[str, int]]:
    """The run's input in its deterministic order (each source shuffled by seed and
    limited; several sources then mixed by the same seed), the duplicates among it, and
    the records per source. A repeated conversation stays an item, skipped as a duplicate,
    so the counts add up to the input. No usable conversation at all is an InputError."""
    cfg = run.config.data
    records, per_source = [], {}
    for source in cfg.sources:
        found = _source_records(run, source)
        per_source[source] = len(found)
        records += found
    if len(cfg.sources) > 1:
        random.Random(cfg.shuffle_seed).shuffle(records)
    first_at: dict[str, str] = {}
    planned = []
    for record in records:
        where = first_at.setdefault(record.key, record.where)
        if where != record.where:
            record = Record(record.where, record.messages, "duplicate conversation")
        planned.append(record)
    if not any(r.rejected is None for r in planned):
        reasons = Counter(r.rejected for r in planned).most_common(3)
        why = "; ".join(f"{n} {reason}" for reason, n in reasons) or "it is empty"
        raise InputError(
            f"{', '.join(cfg.sources)}: no usable conversation among {len(planned)} records ({why})"
        )
    return planned, len(records) - len(first_at), per_source


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


class ChunkWriter:
    """Tokenized samples gathered into chunks; a chunk is durable before its items are done."""

    def __init__(self, run: Run, worker: WorkerSession, partition: tuple[int, int], meta: dict):
        self.run, self.worker, self.meta = run, worker, meta
        self.part = f"{partition[0]}/{partition[1]}"
        self.prefix = f"chunk-p{partition[0]}of{partition[1]}"
        self.directory = run.dir / "data"
        self.results: list[dict[str, Any]] = []
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.first_ord: int | None = None

    def add(
        self, ord_: int, result: dict[str, Any], ids: torch.Tensor | None, mask: torch.Tensor | None
    ) -> None:
        self.first_ord = ord_ if self.first_ord is None else self.first_ord
        if ids is not None:
            result["checksum"] = sample_checksum([ids, mask])
            self.tensors.append((ids, mask))
        self.results.append(result)
        if len(self.results) >= self.run.config.data.samples_per_chunk:
            self.flush()

    def flush(self) -> None:
        if not self.results:
            return
        ledger, shard = self.run.ledger, None
        if self.tensors:
            index, offset = [], 0
            for r in self.results:
                if r["state"] == "done":
                    r["offset"] = offset
                    index.append(IndexEntry(r["key"], offset, r["tokens"], r["checksum"]))
                    offset += r["tokens"]
            name = f"{self.prefix}-{self.first_ord:08d}-{uuid.uuid4().hex[:6]}.safetensors"
            ledger.begin_shard(STAGE, name, self.part)
            size = write_shard(
                self.directory / name,
                {
                    "input_ids": torch.cat([t[0] for t in self.tensors]),
                    "loss_mask": torch.cat([t[1] for t in self.tensors]),
                },
                index,
                self.meta,
            )
            shard = (name, size)
            for r in self.results:
                if r["state"] == "done":
                    r["shard"] = name
        ledger.mark_items(STAGE, self.worker.id, self.results, shard)
        self.results, self.tensors, self.first_ord = [], [], None


def regeneration_identity(run: Run, source_identity: str) -> str | None:
    cfg = run.config.data
    if cfg.regenerate == "none":
        return None
    if cfg.regenerate == "local":
        return f"local:{source_identity}"
    return f"api:{cfg.regen.model}"


def _regenerate_and_tokenize(
    run: Run,
    tokenizer: Any,
    pending: list[Any],
    by_key: dict[str, Record],
    writer: ChunkWriter,
    advance: Any,
    local_model: Callable[[], Any],
) -> None:
    """Regenerate what the ledger does not hold yet, then tokenize; results as they finish."""
    from eagletrain.data.regenerate import regenerate_all, stored_regeneration

    cfg = run.config.data
    ord_of = {item.key: item.ord for item in pending}

    def fits(history: list[dict[str, str]]) -> bool:
        text = tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"]) < cfg.max_length

    def on_result(record: Record, regenerated: Any, error: str | None) -> None:
        if error is not None and error.startswith("skip: "):
            result = {"key": record.key, "state": "skipped", "error": error[len("skip: ") :]}
            writer.add(ord_of[record.key], result, None, None)
        elif error is not None:
            result = {"key": record.key, "state": "failed", "error": error}
            writer.add(ord_of[record.key], result, None, None)
        elif regenerated.truncated and cfg.regen.on_length == "drop":
            result = {"key": record.key, "state": "skipped", "error": "reply hit max_tokens"}
            writer.add(ord_of[record.key], result, None, None)
        else:
            regenerated_record = Record(record.where, regenerated.messages)
            result, ids, mask = _tokenize(run, tokenizer, regenerated_record)
            result["key"] = record.key
            writer.add(ord_of[record.key], result, ids, mask)
        advance()
        inject_delay("data")

    to_send = []
    for item in pending:
        record = by_key[item.key]
        if record.rejected:
            writer.add(item.ord, _tokenize(run, tokenizer, record)[0], None, None)
            advance()
            continue
        stored = stored_regeneration(run.ledger, record)
        if stored is not None:
            on_result(record, stored, None)
        else:
            to_send.append(record)
    if not to_send:
        return
    if cfg.regenerate == "local":
        from eagletrain.data.local_generator import LocalGenerator

        backend: Any = LocalGenerator(
            local_model(),
            tokenizer,
            cfg.regen,
            run.config.run.seed,
            max_prompt_tokens=cfg.max_length,
            note=writer.worker.set_current,  # `status` shows it: a compile takes minutes
        )
    else:
        from eagletrain.data.api_client import ChatClient

        backend = ChatClient(cfg.regen, run.config.run.seed)

    # a first SIGINT/SIGTERM sends no new turn: the turns in flight finish and are kept
    # (per turn in the ledger, whole conversations as samples); a second stops at once,
    # losing only the turns in flight. Either way the next run goes on from there.
    held_back: list[Record] = []
    unfinished = 0

    def admitted(stop: StopRequest) -> Iterator[Record]:
        for i, record in enumerate(to_send):
            if stop.requested:
                held_back.extend(to_send[i:])
                return
            yield record

    async def main(stop: StopRequest) -> None:
        nonlocal unfinished
        async with backend:
            unfinished = await regenerate_all(
                admitted(stop),
                backend,
                run.ledger,
                fits,
                backend.in_flight,
                on_result,
                lambda: stop.requested,
            )

    with StopRequest() as stop:
        try:
            asyncio.run(main(stop))
        finally:
            writer.flush()  # whatever finished is kept, even when the server made us stop
            totals = {**run.ledger.regen_totals(), "requests": backend.requests}
            if getattr(backend, "memory_splits", 0):
                totals["memory_splits"] = backend.memory_splits
            stats = getattr(backend, "decoder_stats", lambda: None)()
            if stats:  # this call's continuous decoder: did its rows find work?
                totals["decoder"] = stats
            run.ledger.update_detail(STAGE, regeneration=totals)
        # a stop that came once every turn was sent ends nothing early
        if held_back or unfinished:
            raise KeyboardInterrupt  # stopped, resumable: the rest is still pending


def run_data(run: Run, partition: tuple[int, int] = (0, 1)) -> None:
    ledger, cfg = run.ledger, run.config
    if ledger.completion(STAGE) is not None:
        return
    source = resolve_target(cfg.target)
    tokenizer = load_tokenizer(source)
    loaded: list[Any] = []

    def local_model() -> Any:
        """The target in this process, loaded once for prompt writing and regeneration."""
        if not loaded:
            device = pick_device(cfg.target.device)
            loaded.append(load_target(source, cfg.target.dtype, device).eval())
        return loaded[0]

    if SELF_SOURCE in cfg.data.sources:
        write_prompts(run, lambda: _prompt_writer(run, tokenizer, local_model))
    records, duplicates, per_source = planned_records(run)
    ledger.begin_stage(STAGE, "items", len(records), "samples")
    ledger.plan_items(
        STAGE,
        ((r.key, i, split_of(r.key, cfg.data.heldout_fraction)) for i, r in enumerate(records)),
    )
    metadata = {
        "target": source.identity,
        "template_hash": template_hash(tokenizer),
        "source": cfg.data.source,
        "records_per_source": per_source,
        "duplicates_dropped": duplicates,
        "regenerated_by": regeneration_identity(run, source.identity),
    }
    ledger.update_detail(STAGE, **metadata)
    by_key = {r.key: r for r in records}
    part = f"{partition[0]}/{partition[1]}"
    directory = run.dir / "data"
    directory.mkdir(parents=True, exist_ok=True)

    def done_count(led) -> int:
        counts = led.counts(STAGE)
        finished = counts.get("done", 0) + counts.get("skipped", 0) + counts.get("failed", 0)
        # regenerated conversations count as progress before their chunk lands
        return finished + (led.regenerated_pending() if cfg.data.regenerate != "none" else 0)

    with WorkerSession(ledger, run.dir, STAGE, part, done_counter=done_count) as worker:
        unfinished = ledger.unfinished_shards(STAGE, part)
        remove_unfinished(directory, unfinished)
        ledger.forget_shards(STAGE, unfinished)
        # a conversation that failed to regenerate last time is tried again
        failed = [i.key for i in ledger.items(STAGE, "failed", partition)]
        ledger.reset_items(STAGE, failed)
        pending = ledger.items(STAGE, "pending", partition)
        writer = ChunkWriter(run, worker, partition, metadata)
        with stage_progress() as bar:
            label = "data" if cfg.data.regenerate == "none" else f"data ({cfg.data.regenerate})"
            task = bar.add_task(label, total=len(pending), unit="samples")
            if cfg.data.regenerate == "none":
                for item in pending:
                    result, ids, mask = _tokenize(run, tokenizer, by_key[item.key])
                    writer.add(item.ord, result, ids, mask)
                    bar.advance(task)
                    if len(writer.results) == 0:
                        inject_delay("data")
                writer.flush()
            else:
                _regenerate_and_tokenize(
                    run, tokenizer, pending, by_key, writer, lambda: bar.advance(task), local_model
                )
        worker.sample_now()
    counts = ledger.counts(STAGE)
    if not counts.get("done") and not counts.get("pending"):
        reasons = "; ".join(f"{n} {why}" for why, n in ledger.error_reasons(STAGE).items())
        raise InputError(f"{cfg.data.source}: no usable conversation, all skipped ({reasons})")
    if not counts.get("pending"):  # complete: what the training split's replies cover
        metadata["assistant_tokens"] = _assistant_token_coverage(run, len(tokenizer))
    finalize_items_stage(run.dir, ledger, STAGE, metadata)


def _assistant_token_coverage(run: Run, vocab_size: int) -> dict[str, Any]:
    """The training split's assistant tokens: how many, and how many of the most frequent
    cover them (the curve `train.draft_vocab_size = "auto"` follows)."""
    samples = DataSamples(run)
    train = [key for key, row in samples.rows.items() if row.split != "heldout"]
    masked = (ids[mask.bool()] for ids, mask in map(samples.get, train))
    return coverage_curve(count_tokens(masked, vocab_size))


def _prompt_writer(run: Run, tokenizer: Any, local_model: Callable[[], Any]):
    """The backend that writes the run's own prompts: the regeneration backend's kind."""
    if run.config.data.regenerate == "local":
        model = local_model()
        return local_writer(model, tokenizer, run.config, target_eos(model, tokenizer))
    return api_writer(tokenizer, run.config)
