"""Local regeneration throughput (the data stage's in-process backend, regen_local.py):
completion tokens/s of `LocalGenerator.generate` over ShareGPT first turns in the stage's
length-grouped batches, per generator configuration KV/ATTENTION/SDPA:

- KV: transformers' `dynamic` cache (grows by concatenation) or `static` (pre-allocated),
  both through `generate`; or `graphed`: static_batch_decoder.py (every batch padded to
  --batch rows in one cache of --max-length + --max-tokens positions, each decoding step a
  CUDA graph on a GPU; its warm-up batch compiles it);
- ATTENTION: `transformers` (its SDPA as it comes: on 5.17 it copies each key/value head
  per query head under a padding mask) or `packed-gqa` (packed_gqa.py);
- SDPA: `cudnn` (every PyTorch backend allowed; cuDNN's plans each new key length anew)
  or `no-cudnn`.

    .venv/bin/python bench/regen_local.py [--prompts 1024] [--batch 512] [--max-tokens 256]
        [--configs dynamic/transformers/cudnn,dynamic/packed-gqa/no-cudnn,...]
        [--model smollm2|PATH] [--source sharegpt|PATH] [--dtype float32] [--device auto]
        [--profile 16 --profile-config KV/ATTENTION/SDPA] [--arrival]

Prompts longer than --max-length tokens are left out (the stage skips them too). Each
configuration runs one untimed batch first (first-call setup). Prints a table, then
`regen_speedup=<x>`: the fastest configuration over the first (the baseline: the stage's
generator before packed-gqa); with `--arrival`, then `pool_speedup=<x>`: batches grouped by
length over all --prompts (the stage's pool) against batches cut in arrival order.
With `--profile N`, one batch of N new tokens a row runs
under torch.profiler first and the operators that took the most time are printed.
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
from eagletrain.target import load_target, load_tokenizer, pick_device, resolve_target


def prompt_tokens(tokenizer, chat: list[dict]) -> int:
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_turns(source: str, tokenizer, count: int, max_length: int) -> list[list[dict]]:
    prompts = []
    for record in read_records(source, "auto", "skip"):
        if not record.messages or record.messages[0]["role"] != "user":
            continue
        chat = [{"role": "user", "content": record.messages[0]["content"]}]
        if prompt_tokens(tokenizer, chat) <= max_length:
            prompts.append(chat)
        if len(prompts) == count:
            break
    return prompts


def padded_share(tokenizer, batches: list[list[list[dict]]]) -> float:
    """Padding positions over all prompt positions, as the left-padded batches hold them."""
    real = padded = 0
    for batch in batches:
        lengths = [prompt_tokens(tokenizer, c) for c in batch]
        real += sum(lengths)
        padded += max(lengths) * len(lengths)
    return 1 - real / padded


def run(
    generator: LocalGenerator, batches: list[list[list[dict]]], device
) -> tuple[int, float, float]:
    """Completion tokens, their seconds, and the untimed warm-up's seconds before them."""
    start = time.perf_counter()
    generator.generate(batches[0][:8])  # untimed: first-call setup, compilation
    if device.type == "cuda":
        torch.cuda.synchronize()
    warm_up = time.perf_counter() - start
    start = time.perf_counter()
    made = sum(c.completion_tokens for b in batches for c in generator.generate(b))
    return made, time.perf_counter() - start, warm_up


def profile(generator: LocalGenerator, batch: list[list[dict]], device, tokens: int) -> None:
    generator.cfg = generator.cfg.model_copy(update={"max_tokens": tokens})
    generator.generate(batch[:8])  # untimed first call
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        generator.generate(batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    print(f"profile: {len(batch)} rows x {tokens} new tokens in {seconds:.2f} s", flush=True)
    ops = prof.key_averages()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(ops.table(sort_by=key, row_limit=18, max_name_column_width=60))
    print(ops.table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))


BASELINE = "dynamic/transformers/cudnn"  # what the data stage ran before packed-gqa


def generator_config(spec: str, max_tokens: int, batch: int) -> RegenerateConfig:
    """`KV/ATTENTION/SDPA`, e.g. `static/packed-gqa/no-cudnn` (RegenerateConfig's fields;
    KV `graphed` is `decoder = "graphed"`)."""
    try:
        kv_cache, attention, sdpa = spec.split("/")
    except ValueError:
        raise SystemExit(f"--configs: {spec!r} is not KV/ATTENTION/SDPA") from None
    graphed = kv_cache == "graphed"
    return RegenerateConfig(
        max_tokens=max_tokens,
        batch_size=batch,
        decoder="graphed" if graphed else "generate",
        kv_cache="dynamic" if graphed else kv_cache,
        attention=attention,
        sdpa_cudnn=sdpa == "cudnn",
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument(
        "--configs",
        default=f"{BASELINE},dynamic/transformers/no-cudnn,dynamic/packed-gqa/no-cudnn,"
        "static/packed-gqa/no-cudnn",
        help="KV/ATTENTION/SDPA,...: the first is the baseline of the printed ratio",
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--source", default="sharegpt")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--profile", type=int, default=0, help="new tokens of a profiled batch")
    parser.add_argument("--profile-config", default="dynamic/packed-gqa/no-cudnn")
    parser.add_argument("--arrival", action="store_true", help="also batches in arrival order")
    args = parser.parse_args()

    device = pick_device(args.device)
    source = resolve_target(TargetConfig(model=args.model))
    model = load_target(source, args.dtype, device)
    tokenizer = load_tokenizer(source)
    prompts = first_turns(args.source, tokenizer, args.prompts, args.max_length)
    orders = {"grouped": length_grouped(prompts, args.batch, lambda c: c)}
    if args.arrival:
        orders["arrival"] = [
            prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)
        ]
    if args.profile:
        cfg = generator_config(args.profile_config, args.profile, args.batch)
        profile(LocalGenerator(model, tokenizer, cfg), orders["grouped"][0], device, args.profile)
    table = Table(
        title=f"local regeneration, {len(prompts)} ShareGPT first turns, batch {args.batch}, "
        f"{args.max_tokens} new tokens at most, {args.dtype} on {device}"
    )
    for col in (
        "kv / attention / sdpa, order",
        "batches",
        "padding share",
        "warm-up s",
        "tokens",
        "s",
    ):
        table.add_column(col, justify="right")
    table.add_column("tok/s", justify="right")
    shares = {order: f"{padded_share(tokenizer, batches):.2f}" for order, batches in orders.items()}
    rates: dict[tuple[str, str], float] = {}
    specs = args.configs.split(",")
    for spec in specs:
        cfg = generator_config(spec, args.max_tokens, args.batch)
        generator = LocalGenerator(model, tokenizer, cfg, max_prompt_tokens=args.max_length)
        for order, batches in orders.items():
            made, seconds, warm_up = run(generator, batches, device)
            rates[spec, order] = made / seconds
            cells = [
                str(len(batches)),
                shares[order],
                f"{warm_up:.1f}",
                str(made),
                f"{seconds:.1f}",
            ]
            table.add_row(f"{spec}, {order}", *cells, f"{made / seconds:.0f}")
            print(
                f"row {spec} {order} warm_up_s={warm_up:.1f} tok_s={made / seconds:.0f}", flush=True
            )
    Console(width=140).print(table)
    best = max(specs[1:] or specs, key=lambda spec: rates[spec, "grouped"])
    print(f"best: {best} against {specs[0]}")
    print(f"regen_speedup={rates[best, 'grouped'] / rates[specs[0], 'grouped']:.2f}")
    if not args.arrival:
        return
    # the whole --prompts pool sorted by length against batches cut in arrival order (the
    # pool the data stage draws from is in_flight_batches x batch_size conversations)
    print(f"pool_speedup={rates[best, 'grouped'] / rates[best, 'arrival']:.2f}")


if __name__ == "__main__":
    main()
