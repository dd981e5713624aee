"""Batched sampling with finished rows refilled: the regeneration and prompt-writing
decoder (`data.regen.decoder = "continuous"`).

A fixed number of rows share one KV cache of rows x width positions, allocated once; each
row holds one request at its own length. Every decoding step feeds each row's last token
at that row's own position and has the same shapes, so it runs as a CUDA graph on a GPU
(one graph per attention width bucket). Every `check_every` steps the host reads which
rows have finished (end of sequence or their token budget), hands their tokens back, and
prefills waiting requests into the freed rows (once `refill_at` rows are free: a larger
refill is fewer, fuller prefill forwards): no row idles until a batch's longest reply
ends, which is where the fixed-batch decoder lost most of its steps.

Attention reads only what is live: "sdpa" attends the widest live row's length (rounded
up to a bucket); "flex" (flex_attention, GPUs) skips each row's blocks past its own
length. The decoder layers are transformers' own modules, driven here because
transformers' caches write every row of a batch at one position.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagletrain.decode.compiled import compiled_steps
from eagletrain.decode.flex_masks import BUCKET, flex_decode, packed_causal_mask
from eagletrain.decode.phase_clock import PhaseClock
from eagletrain.errors import ConfigError

Attention = Literal["sdpa", "flex"]
# a refill's prompts are prefilled sorted by length, in right-padded forwards of at most
# this many positions per decoding row (or one prompt): padding every prompt to the
# refill's longest cost 5.3 of 12.2 s on an H100 (docs/benchmarks.md)
PREFILL_POSITIONS_PER_ROW = 16
# the padded prefill's attention: flash (grouped-query heads and all) and never cuDNN, whose
# plan for each new (rows, length) shape cost ~100 ms a forward on an H100, 15.4 of a
# 21.0 s run (docs/benchmarks.md)
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class Request:
    id: object
    prompt: list[int]
    max_new: int


@dataclass(frozen=True)
class Finished:
    request: Request
    tokens: list[int]  # new tokens, through the first end-of-sequence token if any
    stopped: bool  # ended on an end-of-sequence token (else: its budget)


def check_supported(model: torch.nn.Module) -> None:
    """The layers this decoder drives: Llama-shaped (q/k/v/o projections, two norms, MLP)."""
    layer = model.model.layers[0]
    attn = getattr(layer, "self_attn", None)
    needed = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attn is None or not all(hasattr(attn, n) for n in needed) or hasattr(attn, "q_norm"):
        raise ConfigError(
            f"data.regen.decoder = 'continuous' drives Llama-shaped decoder layers; "
            f"{type(model).__name__} is not one: use decoder 'generate'"
        )


class ContinuousDecoder:
    def __init__(
        self,
        model: torch.nn.Module,
        rows: int,
        width: int,
        max_new: int,
        eos: set[int],
        temperature: float = 0.0,
        top_p: float = 1.0,
        attention: Attention = "sdpa",
        compile: bool = False,
        check_every: int = 8,
        prefill_positions: int | None = None,
        compile_prefill: bool | None = None,
        packed_prefill: bool = False,
        flex_options: dict[str, int] | None = None,
        refill_at: int = 1,
    ):
        """`prefill_positions`: positions per prefill forward (default 16 a row);
        `compile_prefill`: the prefill under torch.compile with dynamic shapes (default: as
        `compile`); `packed_prefill`: a refill's prompts end to end in one sequence, each
        attending only itself (flex attention), instead of right-padded to the longest of
        their group; `flex_options`: flex attention's kernel options for the step (e.g.
        BLOCK_N, num_warps, SPLIT_KV), to tune its decoding kernel; `refill_at`: free rows
        are refilled once at least this many are free (or no row is busy)."""
        check_supported(model)
        self.model, self.rows, self.eos = model, rows, sorted(eos)
        self.set_refills(refill_at, prefill_positions, check_every)
        self.width = math.ceil(width / BUCKET) * BUCKET
        self.temperature, self.top_p, self.attention = temperature, top_p, attention
        self.flex_options = flex_options
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        shape = (rows, self.kv_heads, self.width, self.head_dim)
        self.keys = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in model.model.layers
        ]
        self.values = [torch.zeros_like(k) for k in self.keys]
        # each row's state, on the device (the compiled step updates it in place)
        zeros = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.tokens, self.lengths, self.counts, self.limits = (zeros.clone() for _ in range(4))
        self.active = torch.zeros(rows, dtype=torch.bool, device=self.device)
        self.eos_ids = torch.tensor(self.eos or [-1], dtype=torch.long, device=self.device)
        self.row_index = torch.arange(rows, device=self.device)
        self.max_new = max_new
        self.generated = torch.zeros(rows, max_new, dtype=torch.long, device=self.device)
        for t in (*self.keys, *self.values, self.tokens, self.lengths, self.counts, self.limits,
                  self.active, self.generated):  # fmt: skip
            torch._dynamo.mark_static_address(t)
        self.step, self.compiled = compiled_steps(self._step, compile), compile
        # the prefill's shapes vary with every refill: compiled for dynamic shapes (no CUDA
        # graph), so a forward is a few fused kernels instead of hundreds of eager ones
        self.set_prefill(packed_prefill, compile if compile_prefill is None else compile_prefill)
        self.reset_stats()

    def set_refills(
        self, refill_at: int = 1, prefill_positions: int | None = None, check_every: int = 8
    ) -> None:
        """When and how rows are refilled (the host's side: no recompilation): once
        `refill_at` rows are free, in forwards of at most `prefill_positions` positions
        (default 16 a row), the host checking every `check_every` steps."""
        if not 1 <= refill_at <= self.rows:
            raise ConfigError(f"refill_at {refill_at} must be between 1 and the {self.rows} rows")
        self.refill_at, self.check_every = refill_at, check_every
        self.prefill_budget = prefill_positions or PREFILL_POSITIONS_PER_ROW * self.rows

    def set_prefill(self, packed: bool, compiled: bool) -> None:
        """The refills' prefill: packed or right-padded, compiled or eager (`warm_up`
        compiles it ahead of a timed run)."""
        self.packed_prefill, self.prefill_compiled = packed, compiled
        self.prefill = self._prefill_packed if packed else self._prefill_rows
        if compiled:
            self.prefill = torch.compile(self.prefill, dynamic=True)

    def reset_stats(self) -> None:
        """Zero what `stats()` reports (a bench reuses one decoder for several runs)."""
        self.steps_run = 0
        self.busy_row_steps = 0  # rows holding a request, summed over steps
        self.idle_s = 0.0  # seconds every row sat empty, waiting for a request
        self.attended_columns = 0  # row x column reads of the cache, summed over steps
        self.prompt_tokens = self.prefilled_positions = 0  # real and padded, summed
        self.prefill_forwards = 0
        self.clock = PhaseClock(self.device)  # device seconds in "prefill" and "steps"

    # ---- the model, layer by layer --------------------------------------------------------
    def _forward(
        self, ids: torch.Tensor, positions: torch.Tensor, attend: Callable
    ) -> torch.Tensor:
        """Final-norm hidden states of `ids` [n, t] at `positions`; `attend(layer, q, k, v)`
        stores the new keys/values and returns the attention output [n, heads, t, dim]."""
        inner = self.model.model
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, positions)
        n, t = ids.shape
        for i, layer in enumerate(inner.layers):
            a = layer.self_attn
            x = layer.input_layernorm(h)
            q = a.q_proj(x).view(n, t, -1, self.head_dim).transpose(1, 2)
            k = a.k_proj(x).view(n, t, -1, self.head_dim).transpose(1, 2)
            v = a.v_proj(x).view(n, t, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            o = attend(i, q, k, v)
            h = h + a.o_proj(o.transpose(1, 2).reshape(n, t, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return inner.norm(h)

    def _sample(self, hidden: torch.Tensor) -> torch.Tensor:
        """The next token per row from final-norm hidden states [n, H]: the argmax at
        temperature 0, else a Gumbel-max sample of softmax(logits / T), top-p filtered
        (no host round trip either way)."""
        logits = self.model.lm_head(hidden).float()
        if self.temperature == 0:
            return logits.argmax(-1)
        logits = logits / self.temperature
        if self.top_p < 1.0:
            ordered, order = logits.sort(-1, descending=True)
            probs = ordered.softmax(-1)
            outside = probs.cumsum(-1) - probs > self.top_p  # the smallest set reaching top_p
            ordered = ordered.masked_fill(outside, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
        noise = -torch.log(-torch.log(torch.rand_like(logits).clamp(min=1e-20)))
        return (logits + noise).argmax(-1)

    def _step(self, live: int) -> None:
        """One decoding step of every row, in place: feed each row's token at its length,
        sample the next, advance the rows still running."""
        pos = self.lengths.clamp(max=self.width - 1)  # a finished row writes nowhere useful

        def attend(i: int, q, k, v):
            self.keys[i][self.row_index, :, pos] = k[:, :, 0]
            self.values[i][self.row_index, :, pos] = v[:, :, 0]
            return self._attend_cache(i, q, pos, live)

        hidden = self._forward(self.tokens[:, None], pos[:, None], attend)
        new = self._sample(hidden[:, -1])
        running = self.active
        self.lengths.copy_(torch.where(running, self.lengths + 1, self.lengths))
        at = self.counts.clamp(max=self.generated.shape[1] - 1)
        kept = torch.where(running, new, self.generated[self.row_index, at])
        self.generated[self.row_index, at] = kept
        self.counts.copy_(torch.where(running, self.counts + 1, self.counts))
        self.tokens.copy_(torch.where(running, new, self.tokens))
        ended = torch.isin(new, self.eos_ids) | (self.counts >= self.limits)
        self.active.copy_(running & ~ended)

    def _attend_cache(self, i: int, q: torch.Tensor, pos: torch.Tensor, live: int):
        """Layer `i`'s attention of each row's one query token [n, heads, 1, dim] to its
        cache columns <= pos[row], reading at most the first `live` columns."""
        keys, values = self.keys[i][:, :, :live], self.values[i][:, :, :live]
        # one query token: a group's query heads stand in for query positions, so the
        # keys and values are read once per key/value head. Flex then runs its decoding
        # kernel, which it keeps from grouped-query attention whose group is not a power of
        # two (SmolLM2: 9 query heads on 3)
        n, heads = q.shape[:2]
        grouped = q.view(n, self.kv_heads, heads // self.kv_heads, self.head_dim)
        if self.attention == "flex":
            out = flex_decode(grouped, keys, values, pos, self.flex_options)
        else:
            allowed = torch.arange(live, device=q.device)[None] <= pos[:, None]
            out = F.scaled_dot_product_attention(
                grouped, keys, values, attn_mask=allowed[:, None, None]
            )
        return out.reshape(n, heads, 1, self.head_dim)

    def _prefill(self, slots: list[int], requests: list[Request]) -> None:
        """Each request's prompt into its row and its first token sampled, in forwards of
        at most `prefill_budget` positions: packed end to end, or sorted by length and
        right-padded."""
        order = range(len(requests))
        if not self.packed_prefill:
            order = sorted(order, key=lambda j: len(requests[j].prompt))
        group: list[int] = []
        positions = 0
        for j in order:
            length = len(requests[j].prompt)
            positions = positions + length if self.packed_prefill else (len(group) + 1) * length
            if group and positions > self.prefill_budget:
                self._prefill_group([slots[g] for g in group], [requests[g] for g in group])
                group, positions = [], length
            group.append(j)
        self._prefill_group([slots[g] for g in group], [requests[g] for g in group])

    def _prefill_group(self, slots: list[int], requests: list[Request]) -> None:
        """One forward: the prompts end to end (packed), or right-padded (pads come after
        the real tokens and are never attended)."""
        lengths = [len(r.prompt) for r in requests]
        self.prompt_tokens += sum(lengths)
        self.prefill_forwards += 1
        per_row = torch.tensor(
            [[s, n, r.max_new] for s, n, r in zip(slots, lengths, requests, strict=True)]
        )
        if self.packed_prefill:
            self.prefilled_positions += sum(lengths)
            ids = torch.tensor([t for r in requests for t in r.prompt])[None]
            self.prefill(ids.to(self.device), per_row.to(self.device))  # flex, not SDPA
            return
        longest = max(lengths)
        self.prefilled_positions += longest * len(requests)
        ids = torch.zeros(len(requests), longest, dtype=torch.long)
        for j, r in enumerate(requests):
            ids[j, : len(r.prompt)] = torch.tensor(r.prompt)
        with sdpa_kernel(PREFILL_SDPA):
            self.prefill(ids.to(self.device), per_row.to(self.device))

    def _prefill_packed(self, ids: torch.Tensor, per_row: torch.Tensor) -> None:
        """The forward of `_prefill_group`, packed: `ids` [1, total] the prompts end to
        end, `per_row` [n, 3] = (row, prompt length, token budget) in the same order."""
        from torch.nn.attention.flex_attention import flex_attention

        rows, lengths, limits = per_row.unbind(1)
        n, total = per_row.shape[0], ids.shape[1]
        prompt = torch.repeat_interleave(torch.arange(n, device=self.device), lengths, 0,
                                         output_size=total)  # fmt: skip
        ends = lengths.cumsum(0)
        positions = torch.arange(total, device=self.device) - (ends - lengths)[prompt]
        token_rows = rows[prompt]
        mask = packed_causal_mask(prompt, positions)

        def attend(i: int, q, k, v):
            self.keys[i][token_rows, :, positions] = k[0].transpose(0, 1)
            self.values[i][token_rows, :, positions] = v[0].transpose(0, 1)
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)

        hidden = self._forward(ids, positions[None], attend)
        self._first_tokens(hidden[0, ends - 1], rows, lengths, limits)

    def _prefill_rows(self, ids: torch.Tensor, per_row: torch.Tensor) -> None:
        """The forward of `_prefill_group` on the device: `ids` [n, longest] right-padded,
        `per_row` [n, 3] = (row, prompt length, token budget)."""
        rows, lengths, limits = per_row.unbind(1)
        n, longest = ids.shape
        positions = torch.arange(longest, device=self.device)[None].expand(n, -1)

        def attend(i: int, q, k, v):
            self.keys[i][rows, :, :longest] = k
            self.values[i][rows, :, :longest] = v
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        hidden = self._forward(ids, positions, attend)
        self._first_tokens(hidden[torch.arange(n, device=self.device), lengths - 1], rows,
                           lengths, limits)  # fmt: skip

    def _first_tokens(self, hidden, rows, lengths, limits) -> None:
        """Each prefilled row's first token sampled from its prompt's last hidden state,
        and the row's state set for decoding."""
        first = self._sample(hidden)
        self.tokens[rows] = first
        self.lengths[rows] = lengths
        self.counts[rows] = 1
        self.limits[rows] = limits
        self.generated[rows, 0] = first
        self.active[rows] = ~torch.isin(first, self.eos_ids) & (limits > 1)

    @torch.inference_mode()
    def warm_up(self, on_width: Callable[[str], None] | None = None) -> None:
        """Compile and capture the step of every attention width ahead of any timing (CUDA
        graphs are recorded on a later call than the first), and the compiled prefill; no
        row is live afterwards. Uncompiled, there is nothing to warm. `on_width` hears what
        is compiling: with "sdpa" one step graph per width bucket, minutes on a GPU (294 s
        for 10 widths on an H100)."""
        if self.prefill_compiled:
            if on_width is not None:
                on_width("compiling the prefill")
            for n, length in ((1, 9), (3, 17)):  # one row is a graph of its own
                self._prefill_group(list(range(n)), [Request(None, [0] * length, 2)] * n)
            self.reset_stats()
        self.active.zero_()
        if not self.compiled:
            return
        widths = [self.width] if self.attention == "flex" else range(BUCKET, self.width + 1, BUCKET)
        for n, live in enumerate(widths, 1):
            if on_width is not None:
                on_width(f"compiling the decoder step: width {live} ({n} of {len(widths)})")
            for _ in range(3):
                self.step(live)

    @torch.inference_mode()
    def run(self, take: Take, stop: Callable[[], bool] | None = None) -> Iterator[Finished]:
        """Decode requests as `take(free rows, wait)` hands them over, yielding each as it
        finishes. `take` returns up to that many requests (blocking only when `wait`: no
        row is busy), or None once there will be no more. `stop()` true ends the run at
        once, the rows in flight dropped. A request whose prompt and budget exceed the
        cache is a ValueError."""
        self.active.zero_()
        held: list[Request | None] = [None] * self.rows
        reach = [0] * self.rows  # an upper bound of each row's cache length, on the host
        exhausted = False
        while stop is None or not stop():
            free = [r for r in range(self.rows) if held[r] is None]
            idle = len(free) == self.rows
            asked = time.perf_counter()
            waits = exhausted or not free or (len(free) < self.refill_at and not idle)
            fresh = [] if waits else take(len(free), idle)
            if idle:
                self.idle_s += time.perf_counter() - asked
            if fresh is None:
                exhausted, fresh = True, []
            if fresh:
                fresh = [self._admitted(r) for r in fresh]
                slots = free[: len(fresh)]
                with self.clock("prefill"):
                    self._prefill(slots, fresh)
                for slot, request in zip(slots, fresh, strict=True):
                    held[slot], reach[slot] = request, len(request.prompt)
            if all(h is None for h in held):
                if exhausted:
                    return
                continue
            self.busy_row_steps += (self.rows - held.count(None)) * self.check_every
            with self.clock("steps"):
                for _ in range(self.check_every):
                    live = self.width if self.attention == "flex" else self._live(max(reach))
                    self.step(live)
                    self.steps_run += 1
                    self.attended_columns += self.rows * live
                    reach = [min(x + 1, self.width - 1) for x in reach]
            active = self.active.tolist()
            self.clock.settle()
            done = [r for r in range(self.rows) if held[r] is not None and not active[r]]
            if not done:
                continue
            index = torch.tensor(done, device=self.device)
            counts = self.counts[index].tolist()
            rows = self.generated[index].tolist()
            for r, n, tokens in zip(done, counts, rows, strict=True):
                request, held[r], reach[r] = held[r], None, 0
                tokens = tokens[:n]
                yield Finished(request, tokens, bool(tokens) and tokens[-1] in self.eos)

    def stats(self) -> dict[str, float]:
        """What the decoder did so far: steps, the share of row-steps holding a request
        (the rest: rows that found nothing to decode or wait for a refill), seconds with
        every row empty, and the device's seconds in prefill forwards and in steps as the
        run's checks settled them (other threads call this mid-run: it never settles)."""
        row_steps = self.rows * self.steps_run
        return {
            "rows": self.rows,
            "steps": self.steps_run,
            "rows_busy": round(self.busy_row_steps / row_steps, 4) if row_steps else 0.0,
            "idle_s": round(self.idle_s, 1),
            "refills": self.clock.counts.get("prefill", 0),
            "prefill_forwards": self.prefill_forwards,
            "prefill_s": round(self.clock.seconds.get("prefill", 0), 2),
            "steps_s": round(self.clock.seconds.get("steps", 0), 2),
        }

    def _live(self, longest: int) -> int:
        """The attention width for rows at most `longest` long: its bucket."""
        return min(self.width, math.ceil((longest + 1) / BUCKET) * BUCKET)

    def _admitted(self, request: Request) -> Request:
        budget = min(request.max_new, self.max_new)
        if len(request.prompt) + budget > self.width:
            raise ValueError(
                f"request {request.id}: {len(request.prompt)} prompt tokens + {budget} new "
                f"exceed the decoder's {self.width} positions"
            )
        return Request(request.id, request.prompt, budget)


# (rows free, wait for one) -> requests for them, or None when there will be no more
Take = Callable[[int, bool], list[Request] | None]


def take_from(requests: list[Request]) -> Take:
    """A fixed list of requests as a source for `ContinuousDecoder.run`."""
    source = iter(requests)

    def take(n: int, wait: bool) -> list[Request] | None:
        batch = [r for _, r in zip(range(n), source, strict=False)]
        return batch or None

    return take
