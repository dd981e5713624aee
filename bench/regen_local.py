"""Local regeneration throughput: completion tokens/s of the data stage's in-process
decoders on the same ShareGPT first turns, beside the KV-read limit of the card.

Configurations `DECODER/ROWS[/ATTENTION]`:
- `generate/512`: transformers' generate on length-grouped, left-padded batches (the
  data stage's `decoder = "generate"`, packed-gqa attention);
- `graphed/512`: decode/batch_decoder.py, every batch padded to ROWS rows in one cache,
  each step a CUDA graph, a batch runs until its longest reply ends;
- `continuous/1024/sdpa`, `continuous/1024/flex`: decode/continuous.py, ROWS rows
  refilled as each reply ends, attention to the live width (sdpa) or to each row's own
  blocks (flex); the refills' prefill compiled on a GPU, eager with `/eager`, its
  prompts packed end to end (not right-padded) with `/packed`; `/refill=N` refills once
  N rows are free, `/prefill=N` allows N padded positions a row in one prefill forward
  (default 16), `/check=N` lets N steps pass between the host's checks (default 8).
  Consecutive continuous rows with the same rows and attention reuse one decoder (its
  step compiled once); each row prints where the device's time went (prefill_s, steps_s).

The KV-read limit: every generated token reads its whole context's keys and values
(layers x KV heads x head dim x 2 x dtype bytes per position) and its share of the
weights; the run's real prompt and reply lengths give the bytes, the device's copy
bandwidth (measured here) the seconds. Prints a table, the speedup of the best over the
first configuration, then `regen_tok_s=<best>` last.

    python bench/regen_local.py [--prompts 4096] [--max-tokens 256] [--dtype bfloat16]
        [--configs generate/512,graphed/512,continuous/1024/sdpa,continuous/1024/flex]
        [--model smollm2|PATH] [--source sharegpt|PATH] [--max-length 1024]
        [--row-seconds 0]  # a limit per configuration; a row cut short says so ("cut=")
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from eagletrain.config import RegenerateConfig, TargetConfig
from eagletrain.data.conversations import read_records
from eagletrain.data.local_generator import LocalGenerator, length_grouped
from eagletrain.decode.continuous import ContinuousDecoder, Request, take_from
from eagletrain.target import load_target, load_tokenizer, pick_device, resolve_target, target_eos


def first_turns(source: str, tokenizer, count: int, max_length: int):
    """The first `count` first user turns whose prompt fits `max_length`: (chats, ids)."""
    chats, prompts = [], []
    for record in read_records(source, "auto", "skip"):
        if not record.messages or record.messages[0]["role"] != "user":
            continue
        chat = [{"role": "user", "content": record.messages[0]["content"]}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_length:
            chats.append(chat)
            prompts.append(ids)
        if len(prompts) == count:
            break
    return chats, prompts


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read and written per second by a large device-to-device copy."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * 10 * x.numel() / (time.perf_counter() - start)


def kv_limit(model, prompts: list[list[int]], replies: list[int], rows: int, bw: float) -> float:
    """Completion tokens/s if every step only read its live keys/values and weights at the
    measured bandwidth."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = next(model.parameters()).element_size()
    per_position = cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2 * itemsize
    weights = sum(p.numel() for p in model.parameters()) * itemsize
    context = sum(len(p) * n + n * (n + 1) // 2 for p, n in zip(prompts, replies, strict=True))
    tokens = sum(replies)
    seconds = (context * per_position + tokens * weights / rows) / bw
    return tokens / seconds


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Decoders:
    """One continuous decoder at a time, reused by consecutive configurations with its
    rows and attention (its step compiled and captured once); the prefill kind and the
    host's knobs are set per configuration."""

    def __init__(self, model, width: int, max_tokens: int, eos: set[int]):
        self.model, self.width, self.max_tokens, self.eos = model, width, max_tokens, eos
        self.key: tuple | None = None
        self.decoder: ContinuousDecoder | None = None

    def get(self, rows: int, attention: str) -> ContinuousDecoder:
        if self.key != (rows, attention):
            self.decoder = self.key = None  # its cache freed before the next one's
            torch._dynamo.reset()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.decoder = ContinuousDecoder(
                self.model, rows, self.width, self.max_tokens, self.eos, attention=attention,
                compile=next(self.model.parameters()).is_cuda, compile_prefill=False,
            )  # fmt: skip
            self.key = (rows, attention)
        return self.decoder


def run_continuous(
    decoders: Decoders, prompts, max_tokens, rows, attention, options, seconds, spec
) -> tuple:
    """`options`: "eager" (the prefill uncompiled), "packed" (the prefill packed),
    "refill=N" (refill once N rows are free), "prefill=N" (padded positions a prefill
    forward, per row), "check=N" (steps between the host's checks). After `seconds` of
    decoding (0: no limit) the rows in flight are dropped."""
    knobs = dict(o.split("=") for o in options if "=" in o)
    decoder = decoders.get(rows, attention)
    compiled = decoder.compiled and "eager" not in options
    decoder.set_prefill("packed" in options, compiled)
    names = {"refill": "refill_at", "prefill": "prefill_positions", "check": "check_every"}
    decoder.set_refills(**{
        names[k]: int(v) * (rows if k == "prefill" else 1) for k, v in knobs.items()
    })  # fmt: skip
    start = time.perf_counter()
    decoder.warm_up()  # untimed: the step's graph and a compiled prefill, once a decoder
    sync()
    warm_up = time.perf_counter() - start
    print(f"row {spec} warm-up done in {warm_up:.1f} s", flush=True)
    decoder.reset_stats()
    start = time.perf_counter()
    requests = [Request(i, p, max_tokens) for i, p in enumerate(prompts)]
    stop = (lambda: time.perf_counter() - start > seconds) if seconds else None
    done = list(decoder.run(take_from(requests), stop))
    sync()
    seconds = time.perf_counter() - start
    replies = [0] * len(prompts)
    for f in done:
        replies[f.request.id] = len(f.tokens)
    padding = decoder.prefilled_positions / max(decoder.prompt_tokens, 1)
    return replies, seconds, warm_up, padding, decoder.stats()


def run_batched(model, tokenizer, chats, max_tokens, rows, decoder, width, seconds, spec) -> tuple:
    """The same prompts through LocalGenerator, which applies the chat template itself;
    no batch starts after `seconds` (0: no limit)."""
    cfg = RegenerateConfig(max_tokens=max_tokens, batch_size=rows, decoder=decoder)
    generator = LocalGenerator(model, tokenizer, cfg, max_prompt_tokens=width - max_tokens)
    index = {id(c): i for i, c in enumerate(chats)}
    start = time.perf_counter()
    generator.generate(chats[:rows])  # untimed: first-call setup, compilation
    sync()
    warm_up = time.perf_counter() - start
    print(f"row {spec} warm-up done in {warm_up:.1f} s", flush=True)
    replies = [0] * len(chats)
    start = time.perf_counter()
    for batch in length_grouped(chats, rows, lambda c: c):
        if seconds and time.perf_counter() - start > seconds:
            break
        for chat, done in zip(batch, generator.generate(batch), strict=True):
            replies[index[id(chat)]] = done.completion_tokens
    sync()
    return replies, time.perf_counter() - start, warm_up, None, {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4096)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument(
        "--configs", default="generate/512,graphed/512,continuous/1024/sdpa,continuous/1024/flex"
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--source", default="sharegpt")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--row-seconds", type=float, default=0.0,
        help="each configuration decodes at most this long (0: all prompts); a row cut "
        "short counts the replies finished by then",
    )  # fmt: skip
    args = parser.parse_args()

    device = pick_device(args.device)
    source = resolve_target(TargetConfig(model=args.model))
    model = load_target(source, args.dtype, device).eval()
    tokenizer = load_tokenizer(source)
    eos = target_eos(model, tokenizer)
    chats, prompts = first_turns(args.source, tokenizer, args.prompts, args.max_length)
    width = args.max_length + args.max_tokens
    bandwidth = copy_bandwidth(device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    table = Table(
        title=f"local regeneration, {len(prompts)} ShareGPT first turns, at most "
        f"{args.max_tokens} new tokens, {args.dtype} on {name} "
        f"(copy bandwidth {bandwidth / 1e12:.2f} TB/s)"
    )
    for col in ("decoder / rows / attention", "warm-up s", "tokens", "s", "tok/s",
                "KV-read limit tok/s", "of limit", "prefill padded/real"):  # fmt: skip
        table.add_column(col, justify="right")
    rates: dict[str, float] = {}
    decoders = Decoders(model, width, args.max_tokens, eos)
    for spec in args.configs.split(","):
        decoder, rows, *rest = spec.split("/")
        rows = int(rows)
        try:
            if decoder == "continuous":
                attention = rest[0] if rest else "sdpa"
                replies, seconds, warm, padding, stats = run_continuous(
                    decoders, prompts, args.max_tokens, rows, attention, rest[1:],
                    args.row_seconds, spec,
                )  # fmt: skip
            else:
                replies, seconds, warm, padding, stats = run_batched(
                    model, tokenizer, chats, args.max_tokens, rows, decoder, width,
                    args.row_seconds, spec,
                )  # fmt: skip
        except Exception as err:  # one configuration's failure leaves the others' rows
            print(f"row {spec} failed: {type(err).__name__}: {str(err)[:300]}", flush=True)
            continue
        tokens = sum(replies)
        rates[spec] = tokens / seconds
        finished = sum(n > 0 for n in replies)
        if finished < len(prompts):
            stats = {**stats, "cut": f"{finished}/{len(prompts)}_replies"}
        limit = kv_limit(model, prompts, replies, rows, bandwidth)
        padded = "" if padding is None else f"{padding:.2f}"
        table.add_row(spec, f"{warm:.1f}", str(tokens), f"{seconds:.1f}", f"{rates[spec]:.0f}",
                      f"{limit:.0f}", f"{rates[spec] / limit:.0%}", padded)  # fmt: skip
        print(f"row {spec} warm_up_s={warm:.1f} tokens={tokens} s={seconds:.1f} "
              f"tok_s={rates[spec]:.0f} limit_tok_s={limit:.0f} prefill_padding={padded or '-'}"
              + "".join(f" {k}={v}" for k, v in stats.items()), flush=True)  # fmt: skip
    Console(width=160).print(table)
    specs = list(rates)
    best = max(specs, key=rates.get)
    print(f"best: {best}; regen_speedup={rates[best] / rates[specs[0]]:.2f} over {specs[0]}")
    print(f"regen_tok_s={rates[best]:.0f}")


if __name__ == "__main__":
    main()
