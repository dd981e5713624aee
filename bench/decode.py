"""Acceptance length and wall-clock speedup of a trained run's exported drafter: EAGLE chain,
EAGLE dynamic tree and prompt lookup against plain decoding on the same target, cache and
dtype, per dataset and temperature.

    .venv/bin/python bench/decode.py RUN_DIR [--datasets mtbench,humaneval,heldout]
        [--prompts 16] [--max-new 128] [--temperatures 0,1] [--chain 3] [--tree 32,6,8]
        [--model PATH] [--dtype float32] [--device auto] [--engines eager,compiled]
        [--no-prepack]

Each engine (eager DynamicCache, static cache, compiled: static + torch.compile, CUDA graphs
on a GPU) runs plain and speculative decoding alike, so each speedup is same-engine.
RUN_DIR is a finished run (its export directory is what is loaded, as `eagletrain eval`
does); each result is also saved as RUN_DIR/eval/bench-<dataset>-T<t>.json for
`eagletrain report`. Prints a table, then the first dataset's greedy figures, the chain's
tau last (`chain_tau=<x>`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from eagletrain.decode.tree import TreeShape
from eagletrain.evaluate.in_process import (
    Decoding,
    evaluate_prompts,
    load_for_decoding,
    sized_engine,
)
from eagletrain.evaluate.prompts import dataset_prompts
from eagletrain.runtime.rundir import reopen_run


def add_row(table: Table, engine: str, name: str, temperature: float, r: dict) -> None:
    tokens = sum(p["plain_tokens"] for p in r["per_prompt"])
    low, high = r["tau_ci95"]
    cells = {
        "chain_tau": f"{r['tau']:.3f}",
        "ci95": f"{low:.3f}-{high:.3f}",
        "per_position": "/".join(f"{a:.3f}" for a in r["per_position_acceptance"]),
        "oov_share": f"{r['out_of_vocab_share']:.3f}",
        "chain_speedup": f"{r['speedup']:.2f}",
        "tree_tau": f"{r['tree']['tau']:.3f}",
        "tree_speedup": f"{r['tree']['speedup']:.2f}",
        "lookup_tau": f"{r['prompt_lookup_tau']:.3f}",
        "plain_tok_s": f"{tokens / r['plain_seconds']:.1f}",
    }
    table.add_row(engine, name, f"{temperature:g}", str(r["prompts"]), *cells.values())
    # each row as soon as it is measured: a stopped run keeps what it did
    fields = " ".join(f"{k}={v}" for k, v in cells.items())
    print(f"row {engine} {name} T={temperature:g} prompts={r['prompts']} {fields}", flush=True)


def progress_printer(label: str, total: int):
    """Prints each finished prompt's time since the start (the first includes warm-up:
    compilation and CUDA-graph capture), so a stopped run shows where its time went."""
    began = time.perf_counter()

    def on_prompt(n: int) -> None:
        at = time.perf_counter() - began
        print(f"  {label}: prompt {n}/{total} done at {at:.0f} s", flush=True)

    return on_prompt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--datasets", default="mtbench")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--chain", type=int, default=3)
    parser.add_argument("--tree", default="32,6,8", help="total tokens, depth, top-k")
    parser.add_argument("--model", default=None, help="target path (default: the run's)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--engines", default="eager", help="eager,static,compiled")
    parser.add_argument(
        "--no-prepack", action="store_true", help="on a CPU: keep nn.Linear (not oneDNN-packed)"
    )
    args = parser.parse_args()

    run = reopen_run(args.run_dir)
    prepack = not args.no_prepack and "compiled" not in args.engines
    parts = load_for_decoding(run, args.dtype, args.device, args.model, prepack=prepack)
    model, drafter, device, eos = parts.model, parts.drafter, parts.device, parts.eos
    total, depth, topk = (int(x) for x in args.tree.split(","))
    shape = TreeShape(total, depth, topk)

    table = Table(
        title=f"speculative decoding, run {run.config.run.name}, "
        f"{str(model.dtype).removeprefix('torch.')} on {device}, "
        f"chain {args.chain}, tree {total} tokens / depth {depth} / top-{topk}, "
        f"{args.max_new} new tokens"
    )
    for col in (
        "engine", "dataset", "T", "prompts", "chain tau", "95% CI", "per position",
        "out-of-vocab cycles", "chain speedup", "tree tau", "tree speedup", "lookup tau",
        "plain tok/s",
    ):  # fmt: skip
        table.add_column(col, justify="right")
    prompt_sets = {
        dataset: dataset_prompts(run, parts.tokenizer, dataset, args.prompts)
        for dataset in args.datasets.split(",")
    }
    everything = [p for prompts in prompt_sets.values() for p in prompts]
    headline = None
    for engine in args.engines.split(","):
        # one static engine per kind, sized for every prompt: compiled and captured once
        sizing = Decoding(args.max_new, args.chain, 0.0, 0, shape, engine)
        engines = sized_engine(model, drafter, everything, sizing)
        for dataset, prompts in prompt_sets.items():
            name = Path(dataset).name.split(".")[0]
            for temperature in (float(t) for t in args.temperatures.split(",")):
                settings = Decoding(args.max_new, args.chain, temperature, 0, shape, engine)
                on_prompt = progress_printer(f"{engine} {name} T={temperature:g}", len(prompts))
                r = {
                    "dataset": dataset,
                    "device": str(device),
                    **evaluate_prompts(model, drafter, prompts, settings, eos, on_prompt, engines),
                }
                saved = run.dir / "eval" / f"bench-{engine}-{name}-T{temperature:g}.json"
                saved.parent.mkdir(exist_ok=True)
                saved.write_text(json.dumps(r, indent=2))  # `eagletrain report` shows these
                add_row(table, engine, name, temperature, r)
                if headline is None and temperature == 0:
                    headline = r
    Console(width=160).print(table)
    if headline:
        tree = headline["tree"]
        print(f"tree_tau={tree['tau']:.3f} tree_speedup={tree['speedup']:.3f} "
              f"chain_speedup={headline['speedup']:.3f}")  # fmt: skip
        print(f"chain_tau={headline['tau']:.3f}")


if __name__ == "__main__":
    main()
