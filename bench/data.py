"""Data-stage throughput: regeneration over HTTP, tokenization, local generation.

    .venv/bin/python bench/data.py [--conversations 400] [--concurrency 32]
                                   [--latency 0.05] [--fault-rate 0.3]
                                   [--tokenize 2000] [--local 16] [--max-tokens 64]

1. `regen`: the real data stage (`run_data`, regenerate = "api") on packaged ShareGPT
   conversations against eagletrain's fault server on loopback (its own process), whose
   every reply waits `--latency` seconds like a server's decode time. Rate is taken from
   the ledger's own timestamps (first to last stored conversation), excluding loading.
   `ideal` is concurrency / latency (every slot always busy, no faults); the ratio shows how
   much of the allowed concurrency the client keeps in use.
2. `tokenize`: SmolLM2's chat template + assistant mask on packaged ShareGPT, samples/s.
3. `local`: in-process batched generation with SmolLM2 (the demo's regeneration backend),
   batch 1 against batch `--local`, generated tokens/s.
Prints a table, then `regen_requests_per_s=<x>` last.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from eagletrain.config import Config, RegenerateConfig
from eagletrain.data.chat_tokenize import tokenize_conversation
from eagletrain.data.conversations import read_records
from eagletrain.data.local_generator import LocalGenerator
from eagletrain.data.stage import run_data
from eagletrain.errors import VerifyError
from eagletrain.runtime.rundir import open_run
from eagletrain.target import load_target, load_tokenizer, pick_device, resolve_target


@contextlib.contextmanager
def fault_server(args: argparse.Namespace, fault_rate: float, port: int) -> Iterator[str]:
    """The fault server in its own process, so client and server do not share one GIL."""
    server = Path(__file__).resolve().parent.parent / "tests" / "fault_server.py"
    cmd = [sys.executable, str(server), "--port", str(port)]
    cmd += ["--fault-rate", str(fault_rate), "--latency", str(args.latency), "--stall", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "serving" in proc.stdout.readline()
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait()


def bench_regen(args: argparse.Namespace, fault_rate: float) -> dict[str, float]:
    port = 18000 + int(fault_rate * 100)
    with tempfile.TemporaryDirectory() as tmp, fault_server(args, fault_rate, port) as url:
        regen = {
            "base_url": url,
            "model": "bench",
            "concurrency": args.concurrency,
            "timeout_s": 0.5,
            "max_retries": 6,
            "backoff_base_s": 0.05,
            "backoff_max_s": 0.5,
            "max_tokens": args.max_tokens,
        }
        config = Config.model_validate(
            {
                "data": {
                    "limit": args.conversations,
                    "max_length": 1024,
                    "regenerate": "api",
                    "regen": regen,
                }
            }
        )
        run = open_run(config, Path(tmp) / "run")
        with contextlib.suppress(VerifyError):  # conversations failed for good: counted below
            run_data(run)
        conn = sqlite3.connect(Path(tmp) / "run" / "ledger.sqlite")
        first, last, stored, completion = conn.execute(
            "SELECT MIN(at), MAX(at), COUNT(*), SUM(completion_tokens) FROM regenerated"
        ).fetchone()
        turns = conn.execute("SELECT SUM(turns) FROM regen_totals").fetchone()[0]
        failed = conn.execute("SELECT COUNT(*) FROM items WHERE state='failed'").fetchone()[0]
        detail = json.loads(
            conn.execute("SELECT detail FROM stages WHERE stage='data'").fetchone()[0]
        )
        conn.close()
        requests = detail["regeneration"]["requests"]
        elapsed = last - first
    return {
        "fault_rate": fault_rate,
        "conversations": stored,
        "failed": failed,
        "turns": turns,
        "requests": requests,
        "seconds": elapsed,
        "turns_per_s": turns / elapsed,
        "requests_per_s": requests / elapsed,
        "tokens_per_s": completion / elapsed,
        "ideal_per_s": args.concurrency / args.latency,
    }


def bench_tokenize(tokenizer, n: int) -> dict[str, float]:
    records = [
        r for r in itertools.islice(read_records("sharegpt", "auto", "skip"), n) if r.messages
    ]
    start = time.perf_counter()
    tokens = 0
    for record in records:
        with contextlib.suppress(Exception):  # roles a template refuses: skips in the stage
            tokens += len(tokenize_conversation(tokenizer, record.messages).input_ids)
    elapsed = time.perf_counter() - start
    return {
        "samples": len(records),
        "samples_per_s": len(records) / elapsed,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
    }


def bench_local(tokenizer, args: argparse.Namespace) -> dict[int, float]:
    source = resolve_target(Config().target)
    model = load_target(source, "float32", pick_device("auto"))
    prompts = []
    for record in read_records("sharegpt", "auto", "skip"):
        if record.messages and record.messages[0]["role"] == "user":
            text = record.messages[0]["content"][:400]
            prompts.append([{"role": "user", "content": text}])
        if len(prompts) == args.local:
            break
    cfg = RegenerateConfig(max_tokens=args.max_tokens, batch_size=args.local)
    generator = LocalGenerator(model, tokenizer, cfg)
    rates = {}
    for batch in (1, args.local):
        start = time.perf_counter()
        made = 0
        for i in range(0, len(prompts), batch):
            made += sum(c.completion_tokens for c in generator.generate(prompts[i : i + batch]))
        rates[batch] = made / (time.perf_counter() - start)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--fault-rate", type=float, default=0.3)
    parser.add_argument("--tokenize", type=int, default=2000)
    parser.add_argument("--local", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)

    console = Console(width=140)
    regen = [bench_regen(args, 0.0), bench_regen(args, args.fault_rate)]
    table = Table(
        title=f"regeneration over HTTP (concurrency {args.concurrency}, "
        f"server latency {args.latency}s)"
    )
    for col in (
        "faults",
        "convs",
        "failed",
        "turns",
        "requests",
        "s",
        "turns/s",
        "requests/s",
        "tokens/s",
        "turns/s / ideal",
    ):
        table.add_column(col, justify="right")
    for r in regen:
        table.add_row(
            f"{r['fault_rate']:.0%}",
            str(r["conversations"]),
            str(r["failed"]),
            str(r["turns"]),
            str(r["requests"]),
            f"{r['seconds']:.1f}",
            f"{r['turns_per_s']:.1f}",
            f"{r['requests_per_s']:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['turns_per_s'] / r['ideal_per_s']:.2f}",
        )
    console.print(table)

    tokenizer = load_tokenizer(resolve_target(Config().target))
    tok = bench_tokenize(tokenizer, args.tokenize)
    console.print(
        f"tokenize (SmolLM2 template, packaged ShareGPT): {tok['samples']} samples, "
        f"{tok['samples_per_s']:.0f} samples/s, {tok['tokens_per_s']:.0f} tokens/s"
    )
    if args.local:
        rates = bench_local(tokenizer, args)
        console.print(
            "local generation (SmolLM2, generated tokens/s): "
            + ", ".join(f"batch {b}: {r:.1f}" for b, r in rates.items())
        )
        print(f"local_batch_speedup={rates[args.local] / rates[1]:.2f}")
    print(f"tokenize_samples_per_s={tok['samples_per_s']:.0f}")
    print(f"regen_requests_per_s={regen[1]['requests_per_s']:.1f}")


if __name__ == "__main__":
    main()
