"""Cost of one decoding step per engine: a plain step, a chain cycle (k drafter steps and a
(k + 1)-token verification) and a dynamic-tree cycle, on the eager DynamicCache engine, the
static-cache engine and the compiled one (torch.compile of the target's and the drafter's
fixed-shape steps, CUDA graphs on a GPU), all in the same run.

    .venv/bin/python bench/decode_engine.py [--layers 30] [--width 576] [--vocab 49152]
        [--engines eager,static,compiled] [--tokens 64] [--chain 3] [--tree 32,6,8]
        [--dtype float32] [--device auto] [--profile chain]

Random weights of the given shape (defaults: SmolLM2-135M's 30 layers, width 576, vocab
49152) and a random drafter: acceptance is near zero, so every cycle does the same work and
its time is what decoding overhead costs. A narrow --width isolates per-operation overhead
(what bounds batch-1 decoding of a small model on a GPU). Prints a table, then
`compiled_plain_speedup=<x>` last: eager plain-step time over compiled plain-step time.
With `--profile chain|tree|plain`, that method's decode on each engine then runs once
under torch.profiler: the operators and runtime calls per cycle (graph replays, kernel
launches, host syncs), to show where a cycle's time goes between the compiled graphs.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import LlamaConfig, LlamaForCausalLM

from eagletrain.decode.chain import plain_decode, speculative_chain
from eagletrain.decode.tree import TreeShape, speculative_tree
from eagletrain.drafter import Eagle3Drafter, drafter_config
from eagletrain.evaluate.in_process import Decoding, sized_engine
from eagletrain.target import pick_device


def per_cycle_ms(decode, cycles_of, repeats: int = 3) -> float:
    """Best of `repeats` wall times of one decode, per cycle, in ms."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        result = decode()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / cycles_of(result))
    return 1000 * best


def cycles_counter(method: str):
    """What a decode's time is divided by: tokens (plain) or draft-verify cycles."""
    if method == "plain":
        return lambda r: len(r.tokens)
    return lambda r: len(r.accepted_per_cycle)


def profile_cycles(decode, cycles_of, device: torch.device) -> None:
    """One decode under torch.profiler: the top operators and runtime calls, per cycle."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        cycles = cycles_of(decode())
    events = prof.key_averages()
    per_cycle = Table(title=f"per cycle, over {cycles} cycles (profiled, so slower)")
    for col in ("operator / runtime call", "calls", "self CPU ms", "self device ms"):
        per_cycle.add_column(col, justify="right")
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    for e in ranked:
        device_us = getattr(e, "self_device_time_total", 0) or 0
        per_cycle.add_row(
            e.key[:60],
            f"{e.count / cycles:.1f}",
            f"{e.self_cpu_time_total / 1000 / cycles:.3f}",
            f"{device_us / 1000 / cycles:.3f}",
        )
    Console(width=140).print(per_cycle)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--engines", default="eager,static,compiled")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--chain", type=int, default=3)
    parser.add_argument("--tree", default="32,6,8", help="total tokens, depth, top-k")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--profile", default="", help="plain, chain or tree: profile it")
    args = parser.parse_args()

    device, dtype = pick_device(args.device), getattr(torch, args.dtype)
    heads = max(args.width // 64, 1)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=int(args.width * 8 / 3),
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 3, 1),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device, dtype).eval()
    aux = [1, args.layers // 2 - 1, args.layers - 4]
    drafter = Eagle3Drafter(drafter_config(cfg, 8192, aux)).to(device, dtype).eval()
    drafter.set_draft_vocab(torch.arange(8192, device=device))
    shape = TreeShape(*(int(x) for x in args.tree.split(",")))
    prompt = torch.randint(100, args.vocab, (96,), generator=torch.Generator().manual_seed(0))
    prompt, n, k = prompt.tolist(), args.tokens, args.chain

    table = Table(
        title=f"decoding cost per step/cycle, {args.layers} layers x {args.width} wide, "
        f"{args.dtype} on {device}, chain {k}, tree {args.tree}, {n} new tokens"
    )
    for col in ("engine", "plain step ms", "chain cycle ms", "tree cycle ms", "chain / plain"):
        table.add_column(col, justify="right")
    plain_ms = {}
    for name in args.engines.split(","):
        settings = Decoding(n, k, 0.0, 0, shape, name)
        engine = sized_engine(model, drafter, [("prompt", prompt)], settings)
        eagle = engine.eagle(drafter)
        methods = {
            "plain": lambda e=engine: plain_decode(e, prompt, n, set()),
            "chain": lambda e=engine, p=eagle: speculative_chain(e, p, prompt, n, k, set()),
            "tree": lambda e=engine, p=eagle: speculative_tree(e, p, prompt, n, shape, set()),
        }
        ms = {}
        with torch.inference_mode():
            for method, decode in methods.items():
                started = time.perf_counter()
                decode()  # compile, capture graphs, warm caches: untimed
                decode()
                warmup_s = time.perf_counter() - started
                ms[method] = per_cycle_ms(decode, cycles_counter(method))
                # as each is measured: a time limit that cuts the run keeps what was done
                print(f"{name} {method}: warm-up {warmup_s:.1f} s, {ms[method]:.3f} ms", flush=True)
            if args.profile:
                print(f"profile: {args.profile} on the {name} engine", flush=True)
                profile_cycles(methods[args.profile], cycles_counter(args.profile), device)
        plain_ms[name] = ms["plain"]
        table.add_row(name, *(f"{ms[m]:.2f}" for m in methods), f"{ms['chain'] / ms['plain']:.2f}")
        print(
            f"row {name} plain_ms={ms['plain']:.3f} chain_ms={ms['chain']:.3f} "
            f"tree_ms={ms['tree']:.3f}",
            flush=True,
        )
    Console(width=140).print(table)
    if "eager" in plain_ms and "compiled" in plain_ms:
        print(f"compiled_plain_speedup={plain_ms['eager'] / plain_ms['compiled']:.3f}")


if __name__ == "__main__":
    main()
