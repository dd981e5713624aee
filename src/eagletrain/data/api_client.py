"""An async client for OpenAI-compatible chat completions (hosted routers, vLLM, SGLang).

Fault handling: bounded concurrency (a semaphore), a per-request timeout, retries with
exponential backoff and full jitter that honour `Retry-After` on 429/503, and a circuit
breaker that pauses all requests after a run of consecutive failures and stops the stage
(resumably) when it keeps opening. The API key goes only into the Authorization header;
it is never part of an error message, a log line or anything written to the run directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from eagletrain.config import RegenerateConfig, ServerConfig
from eagletrain.errors import EagletrainError

T = TypeVar("T")
RETRIABLE_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class RegenerationAborted(EagletrainError):
    """The server kept failing (circuit breaker) or refused our credentials: stop, resumable."""

    exit_code = 8


class RequestFailed(Exception):
    """One request failed for good (retries exhausted or not retriable); `reason` is short."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class Completion:
    text: str
    reasoning: str | None
    finish_reason: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0
    # the ids the target generated (without its stop token), where the backend has them:
    # re-tokenizing the text can differ (e.g. one "\n\n" token becomes "\n", "\n")
    token_ids: list[int] | None = None


def parse_completion(body: dict[str, Any]) -> Completion:
    """A chat-completions response body -> Completion, or ValueError naming what is wrong."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("no choices")
    message = choices[0].get("message") or {}
    text = message.get("content")
    # vLLM/SGLang reasoning parsers use `reasoning_content`; some routers use `reasoning`
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if not isinstance(text, str) or not (text.strip() or reasoning):
        raise ValueError("empty content")
    usage = body.get("usage") or {}
    return Completion(
        text=text,
        reasoning=reasoning if isinstance(reasoning, str) and reasoning else None,
        finish_reason=str(choices[0].get("finish_reason") or "unknown"),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        cost=float(usage.get("cost") or 0.0),
    )


def _retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


class CircuitBreaker:
    """Opens after `threshold` consecutive failures; while open every request waits."""

    def __init__(self, threshold: int, cooldown_s: float, max_trips: int):
        self.threshold, self.cooldown_s, self.max_trips = threshold, cooldown_s, max_trips
        self.consecutive = 0
        self.trips = 0
        self._closed = asyncio.Event()
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def success(self) -> None:
        self.consecutive = 0

    async def failure(self) -> None:
        self.consecutive += 1
        if self.consecutive < self.threshold or not self._closed.is_set():
            return
        self.trips += 1
        if self.trips >= self.max_trips:
            raise RegenerationAborted(
                f"regeneration stopped: the server failed {self.consecutive} requests in a row "
                f"{self.trips} times; finished conversations are kept, rerun to resume"
            )
        self._closed.clear()
        await asyncio.sleep(self.cooldown_s)
        self.consecutive = 0
        self._closed.set()


class ServerClient:
    """POSTs to an OpenAI-compatible server with retries, backoff and a circuit breaker
    (chat completions for regeneration, completions for engine hidden-state requests and
    server evaluation); an async context manager."""

    def __init__(self, cfg: ServerConfig, seed: int = 0):
        self.cfg = cfg
        self._key = os.environ.get(cfg.api_key_env, "")
        self._rng = random.Random(seed)
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self.breaker = CircuitBreaker(
            cfg.circuit_failures, cfg.circuit_cooldown_s, cfg.circuit_max_trips
        )
        self.retries = 0
        self.requests = 0

    @property
    def in_flight(self) -> int:
        """Conversations to keep open: enough to keep `concurrency` requests busy."""
        return 2 * self.cfg.concurrency

    async def __aenter__(self) -> ServerClient:
        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        limits = httpx.Limits(max_connections=self.cfg.concurrency)
        self._http = httpx.AsyncClient(
            base_url=self.cfg.base_url.rstrip("/") + "/",
            headers=headers,
            timeout=httpx.Timeout(self.cfg.timeout_s),
            limits=limits,
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        ceiling = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2**attempt)
        delay = self._rng.uniform(0, ceiling)  # full jitter
        return max(delay, retry_after) if retry_after is not None else delay

    async def _once(
        self, endpoint: str, payload: dict[str, Any], parse: Callable[[dict[str, Any]], T]
    ) -> tuple[T | None, str, float | None]:
        """(result, '', None) or (None, reason, retry_after)."""
        try:
            response = await self._http.post(endpoint, json=payload)
        except httpx.TimeoutException:
            return None, "timeout", None
        except httpx.HTTPError as err:  # connection refused/reset, truncated body, ...
            return None, f"transport: {type(err).__name__}", None
        if response.status_code in (401, 403):
            raise RegenerationAborted(
                f"{self.cfg.base_url}: HTTP {response.status_code} (check the API key in "
                f"${self.cfg.api_key_env})"
            )
        if response.status_code != 200:
            reason = f"HTTP {response.status_code}"
            if response.status_code not in RETRIABLE_STATUS:
                raise RequestFailed(reason)
            return None, reason, _retry_after(response)
        try:
            return parse(json.loads(response.content)), "", None
        except (ValueError, TypeError, KeyError) as err:
            return None, f"bad response: {str(err)[:60]}", None

    async def post(
        self, endpoint: str, payload: dict[str, Any], parse: Callable[[dict[str, Any]], T]
    ) -> T:
        """POST {base_url}/{endpoint} with retries, backoff and the circuit breaker; `parse`
        turns a 200 body into the result (ValueError/TypeError/KeyError: a bad body)."""
        reason = ""
        for attempt in range(self.cfg.max_retries + 1):
            await self.breaker.wait_closed()
            async with self._slots:
                self.requests += 1
                result, reason, retry_after = await self._once(endpoint, payload, parse)
            if result is not None:
                self.breaker.success()
                return result
            await self.breaker.failure()
            if attempt < self.cfg.max_retries:
                self.retries += 1
                await asyncio.sleep(self._backoff(attempt, retry_after))
        raise RequestFailed(f"{reason} after {self.cfg.max_retries + 1} attempts")


class ChatClient(ServerClient):
    """The regeneration backend over an API: one chat completion per assistant turn."""

    cfg: RegenerateConfig

    def __init__(self, cfg: RegenerateConfig, seed: int = 0):
        super().__init__(cfg, seed)

    async def complete(self, messages: list[dict[str, str]]) -> Completion:
        payload = {
            "model": self.cfg.model,
            "messages": messages,
            "max_tokens": self.cfg.max_tokens,
            "temperature": self.cfg.temperature,
        }
        return await self.post("chat/completions", payload, parse_completion)
