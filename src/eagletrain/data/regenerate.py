"""Regenerating every assistant turn of a conversation with the target.

Turn by turn: assistant turn i is replaced by the target's reply to the conversation so far,
whose earlier assistant turns are already the target's own (multi-turn regeneration). A
reply's reasoning (`reasoning_content`) is kept beside its content, so the chat template
can place it; it is not sent back in the history. Turns whose prompt no longer fits
`data.max_length` are dropped with everything after them: training would trim them anyway.

Each finished conversation is stored in the ledger before anything else happens to it, and
each regenerated turn of an unfinished one as it comes, so a killed run re-sends only the
turns that were in flight, and a stop needs to wait for no more than those turns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from eagletrain.data.api_client import Completion, RequestFailed
from eagletrain.data.conversations import Message, Record
from eagletrain.runtime.ledger import Ledger


class Backend(Protocol):
    requests: int
    retries: int

    @property
    def in_flight(self) -> int: ...  # conversations worth keeping open

    async def complete(self, messages: list[dict[str, str]]) -> Completion: ...


@dataclass
class Regenerated:
    messages: list[Message]
    finish_reasons: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0

    @property
    def truncated(self) -> bool:
        return "length" in self.finish_reasons

    def row(self) -> dict[str, Any]:
        return {
            "messages": self.messages,
            "finish_reasons": self.finish_reasons,
            "truncated": self.truncated,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost": self.cost,
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Regenerated:
        fields = ("messages", "finish_reasons", "prompt_tokens", "completion_tokens", "cost")
        return cls(**{k: row[k] for k in fields if k in row})


def _history(messages: list[Message]) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


async def regenerate_conversation(
    messages: list[Message],
    backend: Backend,
    fits: Callable[[list[dict[str, str]]], bool],
    resume: Regenerated | None = None,
    on_turn: Callable[[Regenerated], None] | None = None,
    stopping: Callable[[], bool] = lambda: False,
) -> Regenerated:
    """Raises RequestFailed with a short reason when a turn cannot be regenerated, and
    Stopped before a turn is sent once `stopping()` holds.

    `resume` holds turns regenerated earlier (its messages replace a prefix of `messages`);
    `on_turn` sees the conversation so far after each new turn, to store it."""
    out = resume or Regenerated([])
    ended = "first prompt longer than data.max_length"
    for message in messages[len(out.messages) :]:
        if message["role"] != "assistant":
            out.messages.append(dict(message))
            continue
        history = _history(out.messages)
        if not fits(history):
            break
        if stopping():
            raise Stopped
        reply = await backend.complete(history)
        if not reply.text.strip() and not reply.reasoning:
            if not getattr(backend, "deterministic", False):
                raise RequestFailed("empty content")  # a server's empty reply: try again
            # the same request would get the same empty reply: the conversation ends here
            ended = "the target's first reply is empty"
            break
        turn: Message = {"role": "assistant", "content": reply.text}
        if reply.reasoning:
            turn["reasoning_content"] = reply.reasoning
        elif reply.token_ids is not None:
            turn["token_ids"] = reply.token_ids  # tokenization uses the target's own ids
        out.messages.append(turn)
        out.finish_reasons.append(reply.finish_reason)
        out.prompt_tokens += reply.prompt_tokens
        out.completion_tokens += reply.completion_tokens
        out.cost += reply.cost
        if on_turn is not None:
            on_turn(out)
    while out.messages and out.messages[-1]["role"] != "assistant":
        out.messages.pop()  # a question with no reply teaches nothing
    if not out.finish_reasons:
        raise NothingToRegenerate(ended)
    return out


class NothingToRegenerate(Exception):
    """The conversation has no turn that can be regenerated within the length limit."""


class Stopped(Exception):
    """A stop came before the conversation's next turn was sent; its earlier turns are kept."""


OnResult = Callable[[Record, Regenerated | None, str | None], Awaitable[None] | None]


async def regenerate_all(
    records: Iterable[Record],
    backend: Backend,
    ledger: Ledger,
    fits: Callable[[list[dict[str, str]]], bool],
    in_flight: int,
    on_result: OnResult,
    stopping: Callable[[], bool] = lambda: False,
) -> int:
    """Regenerate records with at most `in_flight` conversations open at once. Each result
    is stored in the ledger, then handed to `on_result(record, regenerated, error)`;
    an error starting with "skip: " is a conversation with nothing to regenerate.
    An abort (circuit breaker, bad credentials) cancels the rest and propagates.

    Once `stopping()` holds, no new turn is sent: the turns in flight finish and are kept,
    and their conversations, unfinished, get no result. Returns how many were left so."""
    unfinished = 0

    async def one(record: Record) -> tuple[Record, Regenerated | None, str | None] | None:
        stored = ledger.partial(record.key)
        resume = Regenerated.from_row(stored) if stored is not None else None

        def on_turn(so_far: Regenerated) -> None:
            ledger.save_partial(record.key, so_far.row())

        try:
            regenerated = await regenerate_conversation(
                record.messages or [], backend, fits, resume, on_turn, stopping
            )
        except Stopped:
            return None
        except NothingToRegenerate as err:  # not a failure: retrying cannot help
            return record, None, f"skip: {err}"
        except RequestFailed as err:
            return record, None, f"regenerate: {err.reason}"
        ledger.save_regenerated(record.key, regenerated.row())
        return record, regenerated, None

    pending: set[asyncio.Task] = set()
    finished: list[asyncio.Task] = []
    source = iter(records)
    try:
        while True:
            for record in source:
                pending.add(asyncio.create_task(one(record)))
                if len(pending) >= in_flight:
                    break
            if not pending:
                return unfinished
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            finished = list(done)
            while finished:
                outcome = finished.pop().result()
                if outcome is None:
                    unfinished += 1
                    continue
                result = on_result(*outcome)
                if asyncio.iscoroutine(result):
                    await result
    finally:
        for task in pending:
            task.cancel()
        # collect every outcome (the abort that stopped us included), so none goes unread
        await asyncio.gather(*pending, *finished, return_exceptions=True)


def stored_regeneration(ledger: Ledger, record: Record) -> Regenerated | None:
    row = ledger.regenerated(record.key)
    if row is None:
        return None
    return Regenerated(row["messages"], row["finish_reasons"])
