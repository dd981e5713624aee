"""User requests written by the target itself (`data.source = "self"`): the target is
given its own chat template up to the opening of a user turn (the system header as the
template renders it, `data.prompts.system_prompt`, or one of `system_prompts` by slot: a
mix steered toward kinds of requests), then the slot's opening words if `openings` are
set (a kind of request forced), and samples the rest of the request, stopping at its end
of turn. Degenerate text and exact or near duplicates are dropped, each with its reason
(dedupe.py).

Each prompt slot is a ledger item of the "prompts" stage; every text written is stored
with its slot, attempt and fate in one transaction per batch, so a killed run resumes with
what it kept and never keeps a duplicate. A slot whose text is dropped is written again
(its next attempt) until kept or `max_attempts`. Batches are formed from the pending slots
ordered by (attempt, slot), and each is sampled from a seed of (run seed, its first slot,
attempt), so a resumed run forms and samples the batches an uninterrupted one would.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

import torch

from eagletrain.config import Config, SelfPromptConfig
from eagletrain.data.dedupe import Deduplicator, degenerate
from eagletrain.errors import ConfigError
from eagletrain.runtime.faults import inject_delay
from eagletrain.runtime.progress import stage_progress
from eagletrain.runtime.rundir import Run
from eagletrain.runtime.stop_request import StopRequest
from eagletrain.runtime.worker import WorkerSession
from eagletrain.stages import PROMPTS

STAGE = PROMPTS
SOURCE = "self"
_MARK = "\x00eagletrain-user-turn\x00"

# a batch to write: (slot, attempt) pairs -> (text, tokens, finished at end of turn) each
Writer = Callable[[list[tuple[int, int]]], list[tuple[str, int, bool]]]


def user_turn_prefix(tokenizer: Any, system_prompt: str | None) -> str:
    """The chat template's text up to where a user's words begin."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    text = tokenizer.apply_chat_template(
        [*messages, {"role": "user", "content": _MARK}], tokenize=False
    )
    return text[: text.index(_MARK)]


def slot_prefix(tokenizer: Any, cfg: SelfPromptConfig) -> Callable[[int], str]:
    """slot -> the text the target continues: the user-turn prefix under the slot's system
    prompt, then its opening (each distinct prefix rendered once)."""
    turns = {system: user_turn_prefix(tokenizer, system)
             for system in (cfg.system_prompts or [cfg.system_prompt])}  # fmt: skip
    return lambda slot: turns[cfg.system_prompt_of(slot)] + cfg.opening_of(slot)


def with_opening(cfg: SelfPromptConfig, slot: int, written: str) -> str:
    """The whole request: the slot's opening, then what the target wrote after it."""
    return (cfg.opening_of(slot) + written).strip()


def prompt_count(config: Config) -> int:
    """How many prompts the run keeps: data.prompts.count, else data.limit when "self" is
    the only source."""
    data = config.data
    count = data.prompts.count or (data.limit if data.sources == [SOURCE] else None)
    if count is None:
        raise ConfigError(
            'data.source includes "self": set data.prompts.count (or data.limit when "self" '
            "is the only source)"
        )
    return count


def batch_seed(run_seed: int, slot: int, attempt: int) -> int:
    digest = hashlib.sha256(f"{run_seed}:{slot}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def local_writer(model: torch.nn.Module, tokenizer: Any, config: Config, eos: set[int]) -> Writer:
    """Batches written by the in-process target with the refilling decoder."""
    from eagletrain.decode.continuous import ContinuousDecoder, Request, take_from

    cfg, seed = config.data.prompts, config.run.seed
    prefix_text = slot_prefix(tokenizer, cfg)
    prefixes = [  # slot s's is prefixes[s % cfg.kinds]
        tokenizer(prefix_text(kind), add_special_tokens=False)["input_ids"]
        for kind in range(cfg.kinds)
    ]
    device = next(model.parameters()).device
    decoder = ContinuousDecoder(
        model,
        rows=cfg.batch_size,
        width=max(map(len, prefixes)) + cfg.max_tokens,
        max_new=cfg.max_tokens,
        eos=eos,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        compile=device.type == "cuda",
    )

    decoder.warm_up()

    def write(batch: list[tuple[int, int]]) -> list[tuple[str, int, bool]]:
        torch.manual_seed(batch_seed(seed, *batch[0]))
        requests = [
            Request(i, prefixes[slot % cfg.kinds], cfg.max_tokens)
            for i, (slot, _) in enumerate(batch)
        ]
        done = {f.request.id: f for f in decoder.run(take_from(requests))}
        out = []
        for i, (slot, _) in enumerate(batch):
            tokens = done[i].tokens[:-1] if done[i].stopped else done[i].tokens
            text = with_opening(cfg, slot, tokenizer.decode(tokens, skip_special_tokens=True))
            out.append((text, len(done[i].tokens), done[i].stopped))
        return out

    return write


def api_writer(tokenizer: Any, config: Config) -> Writer:
    """Batches written by an OpenAI-compatible server (its completions endpoint, the
    template prefix as the prompt text), one request per slot with the slot's own seed."""
    from eagletrain.data.api_client import ServerClient

    cfg, server = config.data.prompts, config.data.regen
    prefix_text = slot_prefix(tokenizer, cfg)

    def parse(body: dict[str, Any]) -> tuple[str, int, bool]:
        choice = body["choices"][0]
        text = choice["text"]
        if not isinstance(text, str):
            raise ValueError("no text")
        tokens = int((body.get("usage") or {}).get("completion_tokens") or 0)
        return text, tokens, choice.get("finish_reason") == "stop"

    async def main(batch: list[tuple[int, int]]) -> list[tuple[str, int, bool]]:
        async with ServerClient(server, config.run.seed) as client:
            payloads = [
                {
                    "model": server.model,
                    "prompt": prefix_text(slot),
                    "max_tokens": cfg.max_tokens,
                    "temperature": cfg.temperature,
                    "top_p": cfg.top_p,
                    "seed": batch_seed(config.run.seed, slot, attempt) % 2**31,
                }
                for slot, attempt in batch
            ]
            written = await asyncio.gather(*(client.post("completions", p, parse)
                                             for p in payloads))  # fmt: skip
            return [
                (with_opening(cfg, slot, text), tokens, finished)
                for (slot, _), (text, tokens, finished) in zip(batch, written, strict=True)
            ]

    return lambda batch: asyncio.run(main(batch))


def write_prompts(run: Run, make_writer: Callable[[], Writer]) -> None:
    """Write and filter prompts until `prompt_count` are kept (or every slot has used its
    attempts); resumable; the stage's completion record holds the tally."""
    ledger, cfg = run.ledger, run.config.data.prompts
    if ledger.completion(STAGE) is not None:
        return
    count = prompt_count(run.config)
    ledger.begin_stage(STAGE, "items", count, "prompts")
    ledger.plan_items(STAGE, ((f"{i:09d}", i, None) for i in range(count)))
    dedupe = Deduplicator(cfg.near_duplicate)
    for _, text in ledger.kept_prompts():
        dedupe.duplicate(text)  # remembered: the kept set after a restart
    writer = None

    def kept(led) -> int:
        return led.counts(STAGE).get("done", 0)

    with (
        WorkerSession(ledger, run.dir, STAGE, "0/1", done_counter=kept) as worker,
        stage_progress() as bar,
        StopRequest() as stop,
    ):
        task = bar.add_task("prompts (self)", total=count, completed=kept(ledger), unit="prompts")
        while True:
            pending = sorted(ledger.items(STAGE, "pending"), key=lambda i: (i.attempts, i.ord))
            if not pending:
                break
            if stop.requested:
                raise KeyboardInterrupt  # stopped between batches: resumable
            writer = writer or make_writer()
            batch = [(i.ord, i.attempts) for i in pending[: cfg.batch_size]]
            rows = []
            for (slot, attempt), (text, tokens, finished) in zip(batch, writer(batch), strict=True):
                least = cfg.min_words_of(slot)
                reason = degenerate(text, finished, least) or dedupe.duplicate(text)
                rows.append((slot, attempt, text, tokens, reason))
            ledger.save_prompts(STAGE, worker.id, rows, cfg.max_attempts)
            worker.progressed()
            bar.update(task, completed=kept(ledger))
            inject_delay(STAGE)
        worker.sample_now()
    tally = ledger.prompt_tally(
        mixes={
            "kept_per_system_prompt": len(cfg.system_prompts),
            "kept_per_opening": len(cfg.openings),
        }
    )
    kept_rows = ledger.kept_prompts()
    digest = hashlib.sha256("\n".join(t for _, t in kept_rows).encode()).hexdigest()[:32]
    ledger.complete(STAGE, len(kept_rows), tally["tokens"], digest, False, tally)
