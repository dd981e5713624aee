"""Does a real vLLM (CPU build) serve a drafter whose MLP is wider than its target's
(`train.draft_intermediate_size`)? The exported drafter at DIR and a copy widened with zero
units (gate and up rows, down columns: the same function) are served side by side; both
must accept the same drafts and write the same texts.

    .venv/bin/python bench/widened_drafter_vllm.py --draft DIR [--factor 2] [--prompts 6]
        [--max-tokens 64]

DIR is an exported drafter folder (SGLang format); both are written in vLLM's format and
served by tests/vllm_server.py (--enforce-eager), MT-bench first turns one at a time at
T = 0, counts from each server's /metrics. Prints a table, then
`accepted_ratio=<widened's accepted drafts / the original's>` last.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from eagletrain.config import Config
from eagletrain.drafter import with_wider_mlp
from eagletrain.embedded import embedded_file
from eagletrain.evaluate.server import vllm_counters
from eagletrain.export import load_exported, write_format
from eagletrain.target import resolve_target

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from vllm_server import vllm_python, vllm_servers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--factor", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    original = load_exported(args.draft)
    target = resolve_target(Config().target).directory
    with embedded_file("mtbench").open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = [r["turns"][0] for r in rows[: args.prompts]]
    out = Path(tempfile.mkdtemp(prefix="widened-"))
    drafters = {
        "original": original,
        f"widened x{args.factor}": with_wider_mlp(
            original, args.factor * original.config.intermediate_size
        ),
    }
    servers = []
    for i, drafter in enumerate(drafters.values()):
        write_format(drafter, out / str(i), "vllm", str(target))
        servers.append((out / str(i), out / f"{i}.log"))
    results = {}
    with vllm_servers(vllm_python(), target, servers, 3, True) as urls:
        for name, url in zip(drafters, urls, strict=True):
            metrics = url.removesuffix("/v1") + "/metrics"
            before = vllm_counters(httpx.get(metrics).text)
            texts = []
            for prompt in prompts:
                body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}],
                        "max_tokens": args.max_tokens, "temperature": 0}  # fmt: skip
                reply = httpx.post(f"{url}/chat/completions", json=body, timeout=600).json()
                texts.append(reply["choices"][0]["message"]["content"])
            counts = vllm_counters(httpx.get(metrics).text).plus(before, -1.0)
            results[name] = (counts, texts)

    table = Table(title=f"vLLM serving a drafter and its widened copy ({args.prompts} prompts)")
    for column in ("drafter", "MLP units", "drafts", "accepted", "per position", "same texts"):
        table.add_column(column)
    (_, (base, base_texts)), *_ = results.items()
    for (name, (counts, texts)), drafter in zip(results.items(), drafters.values(), strict=True):
        per = " / ".join(f"{counts.per_position[k]:.0f}" for k in sorted(counts.per_position))
        table.add_row(name, str(drafter.config.intermediate_size), f"{counts.drafts:.0f}",
                      f"{counts.accepted:.0f}", per, str(texts == base_texts))  # fmt: skip
    Console(width=160).print(table)
    widened_counts = list(results.values())[-1][0]
    print(f"accepted_ratio={widened_counts.accepted / max(base.accepted, 1):.3f}")


if __name__ == "__main__":
    main()
