"""Local regeneration throughput (the data stage's in-process backend, regen_local.py):
completion tokens/s of `LocalGenerator.generate` over ShareGPT first turns, batches taken
in arrival order (as before length grouping) against batches grouped by length (what the
stage now does), with transformers' dynamic and static KV caches.

    .venv/bin/python bench/regen_local.py [--prompts 1024] [--batch 512] [--max-tokens 256]
        [--kv-cache dynamic,static] [--model smollm2|PATH] [--source sharegpt|PATH]
        [--dtype float32] [--device auto] [--profile 16] [--attention all,no-cudnn]

Prompts longer than --max-length tokens are left out (the stage skips them too). Each
configuration runs one untimed batch first (first-call setup, compilation). Prints a
table, then `regen_grouped_ratio=<x>`: grouped over arrival-order tokens/s, dynamic cache.
With `--profile N`, one grouped batch of N new tokens per row runs under torch.profiler
first and the operators that took the most time are printed (where a step's time goes).
`--attention all,no-cudnn` repeats each configuration with PyTorch's SDPA backends all
allowed and with cuDNN's left out (on the H200, cuDNN's SDPA built an execution plan for
each new key length, i.e. at every decoding step: 6.5 ms of CPU a call in the profile).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from rich.console import Console
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel

from eagletrain.config import RegenerateConfig, TargetConfig
from eagletrain.conversations import read_records
from eagletrain.regen_local import LocalGenerator, length_grouped
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


def run(generator: LocalGenerator, batches: list[list[list[dict]]], device) -> tuple[int, float]:
    generator.generate(batches[0][:8])  # untimed: first-call setup, compilation
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    made = sum(c.completion_tokens for b in batches for c in generator.generate(b))
    return made, time.perf_counter() - start


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


def attention_backends(name: str):
    """`all`: PyTorch picks among every SDPA backend; `no-cudnn`: every one but cuDNN's."""
    if name == "all":
        return contextlib.nullcontext()
    if name == "no-cudnn":
        allowed = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        return sdpa_kernel(allowed)
    raise SystemExit(f"--attention: unknown {name!r} (all, no-cudnn)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--kv-cache", default="dynamic,static")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--source", default="sharegpt")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--profile", type=int, default=0, help="new tokens of a profiled batch")
    parser.add_argument("--attention", default="all", help="all,no-cudnn: SDPA backends")
    args = parser.parse_args()

    device = pick_device(args.device)
    source = resolve_target(TargetConfig(model=args.model))
    model = load_target(source, args.dtype, device)
    tokenizer = load_tokenizer(source)
    prompts = first_turns(args.source, tokenizer, args.prompts, args.max_length)
    orders = {
        "arrival": [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)],
        "grouped": length_grouped(prompts, args.batch, lambda c: c),
    }
    if args.profile:
        cfg = RegenerateConfig(max_tokens=args.profile, batch_size=args.batch)
        profile(LocalGenerator(model, tokenizer, cfg), orders["grouped"][0], device, args.profile)
    table = Table(
        title=f"local regeneration, {len(prompts)} ShareGPT first turns, batch {args.batch}, "
        f"{args.max_tokens} new tokens at most, {args.dtype} on {device}"
    )
    for col in ("kv cache, attention, order", "batches", "padding share", "tokens", "s", "tok/s"):
        table.add_column(col, justify="right")
    shares = {order: f"{padded_share(tokenizer, batches):.2f}" for order, batches in orders.items()}
    rates: dict[tuple[str, str, str], float] = {}
    for kv_cache in args.kv_cache.split(","):
        cfg = RegenerateConfig(max_tokens=args.max_tokens, batch_size=args.batch, kv_cache=kv_cache)
        generator = LocalGenerator(model, tokenizer, cfg)
        for backends in args.attention.split(","):
            for order, batches in orders.items():
                with attention_backends(backends):
                    made, seconds = run(generator, batches, device)
                rates[kv_cache, backends, order] = made / seconds
                cells = [str(len(batches)), shares[order], str(made), f"{seconds:.1f}"]
                cells.append(f"{made / seconds:.0f}")
                table.add_row(f"{kv_cache}, {backends}, {order}", *cells)
                print(f"row {kv_cache} {backends} {order} tok_s={made / seconds:.0f}", flush=True)
    Console(width=140).print(table)
    first, backends = args.kv_cache.split(",")[0], args.attention.split(",")
    if len(backends) > 1:
        # arrival order is each backend set's first pass over these batches: cuDNN meets
        # every shape fresh, as the data stage does with each new batch
        ratio = rates[first, backends[1], "arrival"] / rates[first, backends[0], "arrival"]
        print(f"regen_{backends[1]}_ratio={ratio:.2f}".replace("-", "_"))
    else:
        b = backends[0]
        print(f"regen_grouped_ratio={rates[first, b, 'grouped'] / rates[first, b, 'arrival']:.2f}")


if __name__ == "__main__":
    main()
