"""Where the refilling decoder's time goes (decode/continuous.py), on random weights of the
target's shape (SmolLM2-135M by default; no model file needed):

- one decoding step per configuration `ATTENTION/ROWS/WIDTH`, rows at synthetic cache
  lengths, against the same step with no attention read ("none": the cache write only)
  and with flex attention as it ran before 2026-12-06 ("flexgqa": query heads ungrouped);
  `flex+BLOCK_N=64+num_warps=8/1024/1280` passes kernel options to flex's decoding kernel;
- one refill's prefill (REFILL prompts of synthetic lengths) and a whole run over synthetic
  requests, split into prefill, steps and the host's share, with the prefill eager or
  compiled for dynamic shapes, right-padded or packed (and the packed refill's keys
  against the padded one's);
- a CUDA kernel table of the first configuration's step.

Lengths: prompts uniform in --prompt-lengths, replies (their budgets; random weights never
stop early) uniform in --reply-lengths. Prints the tables, the step's tokens/s of the best
configuration against the first, then `step_tok_s=<best>` last.

    python bench/regen_step.py [--configs flex/1024/1280,none/1024/1280,sdpa/1024/1280]
        [--steps 30] [--requests 4096] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import LlamaConfig, LlamaForCausalLM

from eagletrain.decode.continuous import ContinuousDecoder, Request, take_from
from eagletrain.decode.flex_masks import BUCKET


class NoAttention(ContinuousDecoder):
    """The step without its attention read: what the rest of the step costs."""

    def _attend_cache(self, i, q, pos, live):
        return q


class UngroupedFlex(ContinuousDecoder):
    """Flex attention as it ran before 2026-12-06: every query head a row of its own with
    `enable_gqa`, which keeps flex from its decoding kernel for SmolLM2's groups of 3."""

    def _attend_cache(self, i, q, pos, live):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        keys, values = self.keys[i], self.values[i]
        n, blocks = q.shape[0], self.width // BUCKET
        kv_blocks = (pos // BUCKET + 1).to(torch.int32).view(n, 1, 1)
        index = torch.arange(blocks, device=q.device, dtype=torch.int32).expand(n, 1, 1, blocks)
        mask = BlockMask.from_kv_blocks(
            kv_blocks, index.contiguous(), BLOCK_SIZE=BUCKET, seq_lengths=(1, self.width),
            mask_mod=lambda b, h, q_idx, kv_idx: kv_idx <= pos[b],
        )  # fmt: skip
        return flex_attention(q, keys, values, block_mask=mask, enable_gqa=True)


class TimedDecoder(ContinuousDecoder):
    """Seconds spent in prefills and steps, each synchronised (so the host's share is the
    rest of a run's time)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefill_s = self.step_s = 0.0
        self.untimed_step = step = self.step

        def timed_step(live: int) -> None:
            start = time.perf_counter()
            step(live)
            sync()
            self.step_s += time.perf_counter() - start

        self.step = timed_step

    def _prefill(self, slots, requests):
        sync()
        start = time.perf_counter()
        super()._prefill(slots, requests)
        sync()
        self.prefill_s += time.perf_counter() - start


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def smollm2_shaped(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip


def uniform(bounds: str, count: int, generator: torch.Generator) -> torch.Tensor:
    lo, hi = (int(x) for x in bounds.split(":"))
    return torch.randint(lo, hi + 1, (count,), generator=generator)


def decoder_for(model, spec: str, max_new: int, compile: bool, first: bool) -> ContinuousDecoder:
    """The first configuration's decoder is timed: the whole run reuses its compiled step."""
    attention, rows, width = spec.split("/")
    attention, *tuning = attention.split("+")  # flex+BLOCK_N=64+num_warps=8: kernel options
    options = {k: int(v) for k, v in (t.split("=") for t in tuning)} or None
    kinds = {"none": NoAttention, "flexgqa": UngroupedFlex}
    kind = kinds.get(attention, TimedDecoder if first else ContinuousDecoder)
    attention = "flex" if attention in kinds else attention
    return kind(model, int(rows), int(width), max_new, set(), attention=attention, compile=compile,
                flex_options=options)  # fmt: skip


def step_ms(decoder: ContinuousDecoder, lengths: torch.Tensor, steps: int) -> tuple[float, int]:
    """Milliseconds a step with every row live at `lengths`, and the attended width."""
    decoder.lengths.copy_(lengths.to(decoder.device))
    decoder.limits.fill_(10**9)
    decoder.active.fill_(True)
    live = (
        decoder.width if decoder.attention == "flex" else decoder._live(int(lengths.max()) + steps)
    )
    step = getattr(decoder, "untimed_step", decoder.step)
    for _ in range(3):
        step(live)
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step(live)
    sync()
    return (time.perf_counter() - start) * 1000 / steps, live


def kernel_table(decoder: ContinuousDecoder, live: int, steps: int) -> None:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if decoder.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            getattr(decoder, "untimed_step", decoder.step)(live)
        sync()
    table = Table(title=f"one step's kernels (mean of {steps} steps)")
    for col in ("kernel / operator", "calls a step", "device ms a step", "share"):
        table.add_column(col, justify="right")
    events = [e for e in prof.key_averages() if (getattr(e, "self_device_time_total", 0) or 0) > 0]
    total = sum(e.self_device_time_total for e in events) or 1
    for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:22]:
        table.add_row(e.key[:90], f"{e.count / steps:.0f}",
                      f"{e.self_device_time_total / 1000 / steps:.3f}",
                      f"{e.self_device_time_total / total:.0%}")  # fmt: skip
    Console(width=160).print(table)


def prefill_runs(decoder: TimedDecoder, args: argparse.Namespace, gen: torch.Generator) -> None:
    """One refill, then a whole run, per prefill variant, on the first configuration's
    decoder; prints their table."""
    rows, attention = decoder.rows, decoder.attention
    decoder.warm_up()
    prompts = uniform(args.prompt_lengths, args.requests, gen)
    budgets = uniform(args.reply_lengths, args.requests, gen)
    requests = [
        Request(i, torch.randint(100, 49000, (int(n),), generator=gen).tolist(), int(b))
        for i, (n, b) in enumerate(zip(prompts, budgets, strict=True))
    ]
    run = Table(
        title=f"refills and whole runs: {len(requests)} requests, {rows} rows, {attention}, "
        "the prefill eager or compiled (dynamic shapes), right-padded or packed"
    )
    for col in ("prefill", f"refill of {args.refill} ms", "prefill s", "steps s", "host s",
                "steps", "tokens", "tok/s (synchronised)"):  # fmt: skip
        run.add_column(col, justify="right")
    refill = list(range(args.refill)), requests[: args.refill]
    refill_tokens = sum(len(r.prompt) for r in refill[1])
    caches = {}
    variants = [(True, False), (True, True), (False, False)]
    if decoder.device.type != "cuda":
        # on a GPU flex attention uncompiled is its unfused reference path: the eager packed
        # refill did not finish one whole run in 250 s on an H100 (2026-12-06)
        variants.append((False, True))
    for compiled, packed in variants:
        name = f"{'compiled' if compiled else 'eager'} {'packed' if packed else 'padded'}"
        decoder.set_prefill(packed, compiled)
        try:
            if compiled:
                decoder.warm_up()  # the prefill's graphs for one row and for several
            for _ in range(3):  # the last is timed (the first ones meet compilation)
                decoder.prefill_s = 0.0
                decoder._prefill(*refill)
        except Exception as err:  # e.g. no compiled flex kernel for this device
            print(f"run prefill={name} failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        refill_ms = decoder.prefill_s * 1000
        caches[name] = torch.stack([k[: args.refill].float() for k in decoder.keys[:2]])
        decoder.prefill_s = decoder.step_s = 0.0
        decoder.steps_run = 0
        decoder.active.zero_()
        start = time.perf_counter()
        done = list(decoder.run(take_from(requests)))
        seconds = time.perf_counter() - start
        tokens = sum(len(f.tokens) for f in done)
        host = seconds - decoder.prefill_s - decoder.step_s
        parts = (decoder.prefill_s, decoder.step_s, host)
        run.add_row(name, f"{refill_ms:.1f}", *(f"{x:.2f}" for x in parts),
                    str(decoder.steps_run), str(tokens), f"{tokens / seconds:.0f}")  # fmt: skip
        print(f"run prefill={name} refill_ms={refill_ms:.1f} ({refill_tokens} prompt tokens) "
              f"prefill_s={decoder.prefill_s:.2f} steps_s={decoder.step_s:.2f} host_s={host:.2f} "
              f"tok_s={tokens / seconds:.0f}", flush=True)  # fmt: skip
    # the same refill's keys (first two layers), packed against padded: the same up to
    # rounding, where each prompt's positions hold keys (the rest of a row is stale)
    both = [m for m in ("compiled", "eager") if {f"{m} packed", f"{m} padded"} <= set(caches)]
    if both:
        lengths = [len(r.prompt) for r in refill[1]]
        padded, packed = caches[f"{both[0]} padded"], caches[f"{both[0]} packed"]
        held = torch.zeros_like(padded[..., :1], dtype=torch.bool)
        for row, n in enumerate(lengths):
            held[:, row, :, :n] = True
        gap = (packed - padded).abs().masked_fill(~held, 0)
        print(f"{both[0]} packed prefill against padded: keys max |diff| {gap.max():.4f} "
              f"(keys max |value| {padded.abs().max():.2f})")  # fmt: skip
    Console(width=160).print(run)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", default="flex/1024/1280,none/1024/1280,sdpa/1024/1280")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompt-lengths", default="20:500")
    parser.add_argument("--reply-lengths", default="20:256")
    parser.add_argument("--refill", type=int, default=64, help="prompts in one timed refill")
    parser.add_argument("--requests", type=int, default=4096, help="requests of the whole run")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--profile-steps", type=int, default=10)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    compile = device.type == "cuda"
    torch.manual_seed(0)
    model = LlamaForCausalLM(smollm2_shaped(args.layers)).to(device, getattr(torch, args.dtype))
    model.eval()
    gen = torch.Generator().manual_seed(0)
    replies_max = int(args.reply_lengths.split(":")[1])

    lengths_note = f"prompt {args.prompt_lengths} + reply {args.reply_lengths}"
    steps = Table(
        title=f"one decoding step, {args.layers} layers, {args.dtype} on {device}, {lengths_note}"
    )
    for col in ("attention / rows / width", "attended width", "step ms", "tok/s", "vs first"):
        steps.add_column(col, justify="right")
    rates: dict[str, float] = {}
    first = None
    for spec in args.configs.split(","):
        rows = int(spec.split("/")[1])
        lengths = (
            uniform(args.prompt_lengths, rows, gen) + uniform(args.reply_lengths, rows, gen) // 2
        )
        try:
            decoder = decoder_for(model, spec, replies_max, compile, first=first is None)
            width = min(decoder.width - args.steps - 8, int(lengths.max()))
            ms, live = step_ms(decoder, lengths.clamp(max=width), args.steps)
        except Exception as err:  # one configuration's failure leaves the others' rows
            print(f"row {spec} failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
            continue
        rates[spec] = rows / ms * 1000
        first = first or spec
        steps.add_row(spec, str(live), f"{ms:.2f}", f"{rates[spec]:.0f}",
                      f"{rates[spec] / rates[first]:.2f}x")  # fmt: skip
        print(f"row {spec} step_ms={ms:.2f} tok_s={rates[spec]:.0f}", flush=True)
        if spec == first and args.profile_steps:
            kernel_table(decoder, live, args.profile_steps)
        # compiled steps hold their decoder (and its cache) until dynamo lets them go
        del decoder
        torch._dynamo.reset()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    Console(width=160).print(steps)
    if first is not None:  # the whole runs last: a slow one leaves every step row printed
        prefill_runs(decoder_for(model, first, replies_max, compile, first=True), args, gen)

    real = [spec for spec in rates if not spec.startswith("none/")]  # "none" reads no cache
    best = max(real, key=rates.get)
    print(f"best: {best}; step_speedup={rates[best] / rates[first]:.2f} over {first}")
    print(f"step_tok_s={rates[best]:.0f}")


if __name__ == "__main__":
    main()
