"""eagletrain's own decoding engine against a real vLLM (CPU build) with the same drafter,
the same target, the same prompts, float32 on this CPU: each one's chain speedup over its
own plain decoding, side by side, measured in one run.

    .venv/bin/python bench/serving_engines.py --draft DIR [--prompts 10] [--max-new 128]
        [--engines eager,static] [--no-prepack] [--vllm-modes compiled]

DIR is an exported drafter folder (its SGLang format for eagletrain; the vLLM format is
written beside it for vLLM). Ours: plain and chain-3 decoding in this process on each
engine (oneDNN-prepacked linears unless --no-prepack), timed per prompt after one untimed
warm-up. vLLM: a server with the drafter and one without (tests/vllm_server.py, its venv
from scripts/vllm_venv.sh), started after ours finished so neither competes for the CPU;
requests one at a time, tau from its /metrics counters. Prints a table, then
`ours_over_vllm=<our best chain speedup / vLLM's>` last.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

from eagletrain.config import Config
from eagletrain.decode.chain import plain_decode, speculative_chain
from eagletrain.decode.cpu_linears import prepack_linears
from eagletrain.decode.engine import DecodingEngine
from eagletrain.evaluate.prompts import chat_prompts
from eagletrain.evaluate.server import vllm_counters
from eagletrain.export import load_exported, write_format
from eagletrain.target import load_target, load_tokenizer, resolve_target, target_eos

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from vllm_server import vllm_python, vllm_server


def ours(target_dir, draft_dir, prompts, max_new, kind, prepack) -> dict:
    model = load_target(target_dir, "float32", torch.device("cpu")).eval()
    drafter = load_exported(draft_dir).float().eval().requires_grad_(False)
    if prepack:
        prepack_linears(model)
        prepack_linears(drafter)
    longest = max(len(p) for p in prompts)
    engine = DecodingEngine.sized(model, kind, drafter, longest, max_new, 3)
    eos = target_eos(model, load_tokenizer(target_dir))
    plain_s = spec_s = 0.0
    tokens = cycles = accepted = 0
    with torch.inference_mode():
        plain_decode(engine, prompts[0], 16, eos)  # untimed warm-up
        speculative_chain(engine, engine.eagle(drafter), prompts[0], 16, 3, eos)
        for prompt in prompts:
            plain = plain_decode(engine, prompt, max_new, eos)
            spec = speculative_chain(engine, engine.eagle(drafter), prompt, max_new, 3, eos)
            assert spec.tokens == plain.tokens, "greedy speculative output differs"
            plain_s, spec_s = plain_s + plain.seconds, spec_s + spec.seconds
            tokens += len(plain.tokens)
            cycles += len(spec.accepted_per_cycle)
            accepted += sum(spec.accepted_per_cycle)
    return {
        "plain_tok_s": tokens / plain_s,
        "chain_tok_s": tokens / spec_s,
        "tau": 1 + accepted / cycles,
        "speedup": plain_s / spec_s,
        "threads": torch.get_num_threads(),
    }


def timed_requests(url: str, prompts, max_new: int) -> tuple[float, int, list[str]]:
    seconds, tokens, texts = 0.0, 0, []
    with httpx.Client(timeout=600) as http:
        warm = {"model": "smollm2", "prompt": prompts[0], "max_tokens": 16, "temperature": 0}
        http.post(f"{url}/completions", json=warm)
        for prompt in prompts:
            body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_new, "temperature": 0}
            start = time.perf_counter()
            reply = http.post(f"{url}/completions", json=body).json()
            seconds += time.perf_counter() - start
            tokens += reply["usage"]["completion_tokens"]
            texts.append(reply["choices"][0]["text"])
    return seconds, tokens, texts


def vllm(python, target_dir, vllm_draft, prompts, max_new, eager, logs) -> dict:
    mode = "eager" if eager else "compiled"
    with vllm_server(python, target_dir, None, logs / f"plain-{mode}.log", eager=eager) as url:
        plain_s, plain_tokens, plain_texts = timed_requests(url, prompts, max_new)
    log = logs / f"eagle-{mode}.log"
    with vllm_server(python, target_dir, vllm_draft, log, eager=eager) as url:
        metrics = url.removesuffix("/v1") + "/metrics"
        before = vllm_counters(httpx.get(metrics).text)
        spec_s, spec_tokens, spec_texts = timed_requests(url, prompts, max_new)
        spent = vllm_counters(httpx.get(metrics).text).plus(before, -1.0)
    equal = sum(a == b for a, b in zip(plain_texts, spec_texts, strict=True))
    return {
        "plain_tok_s": plain_tokens / plain_s,
        "chain_tok_s": spec_tokens / spec_s,
        # the warm-up request's cycles are before `before`: these are the prompts' own
        "tau": 1 + spent.accepted / spent.drafts,
        "speedup": (plain_s / plain_tokens) / (spec_s / spec_tokens),
        "equal": f"{equal}/{len(prompts)}",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--draft", type=Path, required=True, help="exported SGLang folder")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--engines", default="eager")
    parser.add_argument("--no-prepack", action="store_true")
    parser.add_argument("--vllm-modes", default="compiled", help="compiled,eager")
    args = parser.parse_args()
    target_dir = resolve_target(Config().target)
    tokenizer = load_tokenizer(target_dir)
    # every 4th MT-bench first turn (80 / 4 = 20 at most)
    prompts = [ids for _, ids in chat_prompts(tokenizer, "mtbench")[::4][: args.prompts]]
    rows = {}
    for kind in args.engines.split(","):
        for prepack in [False] if args.no_prepack else [False, True]:
            name = f"eagletrain {kind}" + (" + oneDNN" if prepack else "")
            rows[name] = ours(target_dir, args.draft, prompts, args.max_new, kind, prepack)
            print(f"row {name} " + " ".join(f"{k}={v}" for k, v in rows[name].items()), flush=True)
    python = vllm_python()
    with tempfile.TemporaryDirectory() as tmp:
        vllm_draft = Path(tmp) / "vllm"
        write_format(load_exported(args.draft), vllm_draft, "vllm", str(target_dir.directory))
        for mode in args.vllm_modes.split(","):
            name = f"vLLM {mode}"
            rows[name] = vllm(python, target_dir.directory, vllm_draft, prompts, args.max_new,
                              mode == "eager", Path(tmp))  # fmt: skip
            print(f"row {name} " + " ".join(f"{k}={v}" for k, v in rows[name].items()), flush=True)
    table = Table(
        title=f"chain 3, greedy, float32 on this CPU, {len(prompts)} MT-bench first turns, "
        f"{args.max_new} new tokens"
    )
    for col in ("engine", "plain tok/s", "chain tok/s", "tau", "chain speedup"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        table.add_row(name, f"{r['plain_tok_s']:.1f}", f"{r['chain_tok_s']:.1f}",
                      f"{r['tau']:.3f}", f"{r['speedup']:.2f}x")  # fmt: skip
    Console(width=120).print(table)
    best_ours = max(r["speedup"] for n, r in rows.items() if n.startswith("eagletrain"))
    best_vllm = max(r["speedup"] for n, r in rows.items() if n.startswith("vLLM"))
    print(f"ours_over_vllm={best_ours / best_vllm:.3f}")


if __name__ == "__main__":
    main()
