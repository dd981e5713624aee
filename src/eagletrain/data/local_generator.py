"""Regeneration with the in-process target: requests from many conversations are gathered
into left-padded batches for `model.generate` (or, with `decoder = "graphed"`, for
static_batch_decoder.py's fixed-shape steps), so the CPU demo and GPU runs need no server.

It offers the same `complete(messages) -> Completion` as the HTTP client, so the
multi-turn driver in regenerate.py does not know which one it talks to.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from eagletrain.config import RegenerateConfig
from eagletrain.data.api_client import Completion
from eagletrain.decode.batch_decoder import StaticBatchDecoder
from eagletrain.decode.continuous import ContinuousDecoder, Request
from eagletrain.decode.packed_gqa import set_attention
from eagletrain.target import target_eos

T = TypeVar("T")
ABORT_WAIT_S = 10.0  # how long a stop waits for the decoding thread's current steps


def length_grouped(
    requests: list[T], batch_size: int, messages: Callable[[T], list[dict[str, str]]]
) -> list[list[T]]:
    """Batches of at most `batch_size` requests of similar length (characters of their
    messages, a proxy for tokens): a left-padded batch runs at its longest prompt's width,
    so grouping by length keeps the padding, and the prefill and cache it costs, small."""
    ordered = sorted(requests, key=lambda r: sum(len(m.get("content") or "") for m in messages(r)))
    return [ordered[i : i + batch_size] for i in range(0, len(ordered), batch_size)]


class LocalGenerator:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        cfg: RegenerateConfig,
        seed: int = 0,
        max_prompt_tokens: int | None = None,
        note: Callable[[str], None] | None = None,
    ):
        """`max_prompt_tokens` bounds a request's prompt (the graphed decoder's cache holds
        it plus `cfg.max_tokens`); longer prompts are refused there. `note` hears what the
        decoder is doing when it is not decoding (compiling), on the event loop's thread."""
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.note = note
        self.device = next(model.parameters()).device
        self.seed = seed
        self.requests = 0
        self.retries = 0  # local generation does not retry; kept for the same summary
        self.memory_splits = 0  # batches halved because the device ran out of memory
        # greedy replies repeat: an empty one would be empty again (regenerate.py)
        self.deterministic = cfg.temperature == 0
        self._queue: asyncio.Queue[tuple[list[dict[str, str]], asyncio.Future]] = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = tokenizer.eos_token_id
        self.eos = sorted(target_eos(model, tokenizer))
        set_attention(model, cfg.attention)
        self._decoder: StaticBatchDecoder | None = None
        self._continuous: ContinuousDecoder | None = None
        self.decoding_s = 0.0  # the continuous decoder's time from its first request on
        if cfg.decoder != "generate" and max_prompt_tokens is None:
            raise ValueError(f"decoder {cfg.decoder!r} needs max_prompt_tokens")
        on_gpu = self.device.type == "cuda"
        if cfg.decoder == "graphed":
            self._decoder = StaticBatchDecoder(
                model,
                rows=cfg.batch_size,
                width=max_prompt_tokens + cfg.max_tokens,
                temperature=cfg.temperature,
                compile=on_gpu,
            )
        elif cfg.decoder == "continuous":
            self._continuous = ContinuousDecoder(
                model,
                rows=cfg.batch_size,
                width=max_prompt_tokens + cfg.max_tokens,
                max_new=cfg.max_tokens,
                eos=set(self.eos),
                temperature=cfg.temperature,
                attention=cfg.continuous_attention,
                compile=on_gpu,
                packed_prefill=cfg.packed_prefill,
                compile_prefill=on_gpu and cfg.compile_prefill,
                refill_at=min(cfg.continuous_refill_rows, cfg.batch_size),
                check_every=cfg.continuous_check_every,
                prefill_positions=cfg.continuous_prefill_positions * cfg.batch_size,
            )

    def _sdpa_backends(self) -> contextlib.AbstractContextManager:
        if self.device.type != "cuda" or self.cfg.sdpa_cudnn:
            return contextlib.nullcontext()
        allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        return sdpa_kernel(allowed)

    @property
    def in_flight(self) -> int:
        """Conversations to keep open: the waiting pool that batches are grouped from."""
        return self.cfg.batch_size * self.cfg.in_flight_batches

    async def __aenter__(self) -> LocalGenerator:
        # one thread runs every batch: CUDA graphs are recorded per thread
        if self._continuous is not None:
            self._loop = asyncio.get_running_loop()
            self._feed: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
            self._waiting: set[asyncio.Future] = set()
            self._ending = False
            self._abort = threading.Event()
            self._regen_thread = threading.Thread(
                target=self._decode_continuously, name="regen", daemon=True
            )
            self._regen_thread.start()
            return self
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regen")
        self._worker = asyncio.create_task(self._serve())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if self._continuous is not None:
            self._feed.put(None)  # the decoder finishes its rows and ends
            if exc_type is not None:
                # stopped at once (a second SIGINT) or failed: the rows in flight are
                # dropped, and the thread ends before the process does: one still inside
                # a kernel at exit aborts it ("terminate called without an active
                # exception"). A warm-up (compiling) is not waited out.
                self._abort.set()
                self._regen_thread.join(timeout=ABORT_WAIT_S)
        if self._worker is not None:
            self._worker.cancel()
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    async def complete(self, messages: list[dict[str, str]]) -> Completion:
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        if self._continuous is None:
            await self._queue.put((messages, future))
            return await future
        prompt = self._encode(messages)
        self._waiting.add(future)
        self._feed.put(Request(future, prompt, self.cfg.max_tokens))
        finished = await future
        self.requests += 1
        return self._completion(prompt, finished.tokens)

    def _take(self, n: int, wait: bool) -> list[Request] | None:
        """Up to n queued requests for the decoder's free rows (blocking for the first only
        when no row is busy); None once the generator is closing and nothing is left."""
        batch: list[Request] = []
        while len(batch) < n and not self._ending:
            try:
                item = self._feed.get(block=wait and not batch)
            except queue.Empty:
                break
            if item is None:
                self._ending = True
                break
            batch.append(item)
        return None if not batch and self._ending else batch

    def _decode_continuously(self) -> None:
        """The decoding thread: every request as rows free up, each answer handed back to
        its conversation as soon as it ends; an error fails every waiting conversation."""

        def resolve(future: asyncio.Future, result: object, error: BaseException | None):
            self._waiting.discard(future)
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        try:
            torch.manual_seed(self.seed)
            with self._sdpa_backends():
                self._continuous.warm_up(self._note_from_thread)
                self._note_from_thread("decoding")
                started = time.perf_counter()
                for done in self._continuous.run(self._take, self._abort.is_set):
                    self.decoding_s = time.perf_counter() - started
                    self._loop.call_soon_threadsafe(resolve, done.request.id, done, None)
        except Exception as err:  # the decoder failed: no conversation waits forever
            for future in list(self._waiting):
                self._loop.call_soon_threadsafe(resolve, future, None, err)

    def decoder_stats(self) -> dict[str, float] | None:
        """The continuous decoder's occupancy in this process (None for the others)."""
        if self._continuous is None:
            return None
        return {**self._continuous.stats(), "decoding_s": round(self.decoding_s, 1)}

    def _note_from_thread(self, what: str) -> None:
        if self.note is not None:
            self._loop.call_soon_threadsafe(self.note, what)

    async def _serve(self) -> None:
        while True:
            waiting = [await self._queue.get()]
            await asyncio.sleep(0)  # let the other conversations enqueue their turn
            while not self._queue.empty():
                waiting.append(self._queue.get_nowait())
            for batch in length_grouped(waiting, self.cfg.batch_size, lambda w: w[0]):
                try:
                    results = await asyncio.get_running_loop().run_in_executor(
                        self._thread, self.generate, [m for m, _ in batch]
                    )
                except Exception as err:  # hand the error to every waiting conversation
                    for _, future in batch:
                        future.set_exception(err)
                    continue
                for (_, future), result in zip(batch, results, strict=True):
                    future.set_result(result)

    def generate(self, conversations: list[list[dict[str, str]]]) -> list[Completion]:
        """One completion per conversation; a batch the device cannot hold is halved (and
        each half again) rather than failing, so a large batch_size costs speed, not the run."""
        try:
            return self._generate_batch(conversations)
        except torch.OutOfMemoryError:
            if len(conversations) == 1 or self._decoder is not None:
                raise  # the graphed decoder's shapes do not shrink with the batch
        self.memory_splits += 1
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        half = len(conversations) // 2
        return self.generate(conversations[:half]) + self.generate(conversations[half:])

    def _encode(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _completion(self, prompt: list[int], tokens: list[int]) -> Completion:
        """The reply of `tokens` (new tokens, through an end-of-sequence token if any)."""
        ended = next((j for j, t in enumerate(tokens) if t in self.eos), None)
        kept = tokens if ended is None else tokens[:ended]
        return Completion(
            text=self.tokenizer.decode(kept, skip_special_tokens=True),
            reasoning=None,
            finish_reason="stop" if ended is not None else "length",
            prompt_tokens=len(prompt),
            completion_tokens=len(kept) + (ended is not None),
            token_ids=kept,
        )

    @torch.inference_mode()
    def _generate_batch(self, conversations: list[list[dict[str, str]]]) -> list[Completion]:
        encoded = [self._encode(m) for m in conversations]
        sampling = self.cfg.temperature > 0
        if sampling:
            torch.manual_seed(self.seed + self.requests)
        with self._sdpa_backends():
            if self._decoder is not None:
                outputs = self._decoder.generate(
                    encoded, self.cfg.max_tokens, set(self.eos), self.pad_id
                )
            else:
                outputs = self._generate(encoded, sampling)
        self.requests += len(encoded)
        return [self._completion(e, tokens) for e, tokens in zip(encoded, outputs, strict=True)]

    def _generate(self, encoded: list[list[int]], sampling: bool) -> list[list[int]]:
        """New tokens per prompt through transformers' generate (left-padded)."""
        longest = max(len(e) for e in encoded)
        # left padding: every row's next token lands in the same column
        ids = torch.full((len(encoded), longest), self.pad_id, dtype=torch.long)
        attention = torch.zeros_like(ids)
        for row, e in enumerate(encoded):
            ids[row, longest - len(e) :] = torch.tensor(e)
            attention[row, longest - len(e) :] = 1
        static = {"cache_implementation": "static", "disable_compile": True}
        out = self.model.generate(
            input_ids=ids.to(self.device),
            attention_mask=attention.to(self.device),
            max_new_tokens=self.cfg.max_tokens,
            do_sample=sampling,
            temperature=self.cfg.temperature if sampling else None,
            top_p=None,
            top_k=None,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos,
            **(static if self.cfg.kv_cache == "static" else {}),
        )[:, longest:].cpu()
        return out.tolist()
