"""Two drafters on the same prompts, paired: the ratio of their chain and tree tau with a
bootstrap interval that resamples prompts jointly (a prompt's own difficulty cancels, so a
gain that two separate intervals cannot tell apart can still be measured), overall and per
MT-bench category (from the packaged MT-bench's `category`).

    .venv/bin/python bench/compare_drafters.py BASE.json NEW.json [--by-category]

BASE.json and NEW.json are `bench/decode.py` results (RUN_DIR/eval/bench-*.json) of the
same dataset, temperature and chain length. Prints a table, then `chain_tau_ratio=<x>`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from eagletrain.decode.acceptance import paired_tau_ratio
from eagletrain.embedded import embedded_file


def per_prompt(path: Path) -> tuple[dict, dict[str, dict]]:
    result = json.loads(path.read_text())
    return result, {p["id"]: p for p in result["per_prompt"]}


def mtbench_categories() -> dict[str, str]:
    with embedded_file("mtbench").open(encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {str(r["question_id"]): r["category"] for r in rows}


def chain(p: dict) -> tuple[float, int]:
    # tokens as the pooled tau counts them: accepted drafts plus a bonus a cycle
    return p["tau"] * p["cycles"], p["cycles"]


def tree(p: dict) -> tuple[float, int] | None:
    # results written before 2026-12-07 lack the tree's cycles
    return (p["tree_tau"] * p["tree_cycles"], p["tree_cycles"]) if "tree_cycles" in p else None


def pooled(per_prompt: list[tuple[float, int]]) -> float:
    return sum(t for t, _ in per_prompt) / sum(c for _, c in per_prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--by-category", action="store_true", help="MT-bench categories")
    args = parser.parse_args()
    base_result, base = per_prompt(args.base)
    new_result, new = per_prompt(args.new)
    for key in ("dataset", "temperature", "draft_steps"):
        if base_result[key] != new_result[key]:
            raise SystemExit(
                f"{args.new}: {key} {new_result[key]!r} is not {args.base}'s {base_result[key]!r}"
            )
    ids = [i for i in base if i in new]
    if not ids:
        raise SystemExit(f"{args.new}: no prompt in common with {args.base}")
    groups = {"all": ids}
    if args.by_category:
        if base_result["dataset"] != "mtbench":
            raise SystemExit(
                f"{args.base}: --by-category reads MT-bench's categories, not "
                f"{base_result['dataset']}'s"
            )
        category = mtbench_categories()
        for i in ids:
            groups.setdefault(category.get(i, "unknown"), []).append(i)

    table = Table(title=f"{args.base.name} -> {args.new.name}, {len(ids)} prompts in common")
    for column in (
        "prompts",
        "group",
        "chain tau",
        "chain ratio [95% CI]",
        "tree tau",
        "tree ratio [95% CI]",
    ):
        table.add_column(column)
    for name, group in groups.items():
        cells = [str(len(group)), name]
        for measure in (chain, tree):
            a = [measure(base[i]) for i in group]
            b = [measure(new[i]) for i in group]
            if None in a or None in b:
                cells += ["-", "-"]
                continue
            ratio, low, high = paired_tau_ratio(a, b)
            cells += [f"{pooled(a):.3f} -> {pooled(b):.3f}", f"{ratio:.3f} [{low:.3f}-{high:.3f}]"]
            if name == "all" and measure is chain:
                headline = ratio
        table.add_row(*cells)
    Console(width=160).print(table)
    print(f"chain_tau_ratio={headline:.3f}")


if __name__ == "__main__":
    main()
