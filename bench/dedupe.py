"""The prompt filter's duplicate detection (data/dedupe.py), measured: throughput, what it
drops from real written prompts, and how right its near-duplicate calls are.

    .venv/bin/python bench/dedupe.py [--ledger RUN/ledger.sqlite] [--threshold 0.7]

Texts: every prompt a run's target wrote (its `self_prompts` table, in writing order), or
with no --ledger the packaged ShareGPT first turns. Precision: each text called a near
duplicate against the kept text it was matched to, by the exact Jaccard similarity of
their word 3-gram sets (LSH finds candidates; the exact similarity decides). Recall: for
2,000 kept texts of 12 words or more, a copy with one word replaced and one appended;
those whose exact similarity reaches the threshold are near duplicates by definition, and
the share of them caught is the recall. False calls: half of one kept text spliced to
half of another (below the threshold with both). Prints a table, then
`dedupe_texts_per_s=<x>` last.
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import time

from rich.console import Console
from rich.table import Table

from eagletrain.data.conversations import read_records
from eagletrain.data.dedupe import Deduplicator, normalized, shingles


def jaccard(a: str, b: str) -> float:
    x, y = shingles(normalized(a).split()), shingles(normalized(b).split())
    return len(x & y) / len(x | y) if x | y else 1.0


def texts_from(ledger: str | None) -> list[str]:
    if ledger:
        conn = sqlite3.connect(ledger)
        rows = conn.execute("SELECT text FROM self_prompts ORDER BY at, slot, attempt")
        return [t for (t,) in rows]
    out = []
    for record in read_records("sharegpt", "auto", "skip"):
        if record.messages and record.messages[0]["role"] == "user":
            out.append(record.messages[0]["content"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ledger", default=None)
    parser.add_argument("--threshold", type=float, default=0.7)
    args = parser.parse_args()
    texts = texts_from(args.ledger)
    dedupe = Deduplicator(args.threshold)
    kept: list[str] = []
    reasons: dict[str, int] = {}
    near: list[str] = []
    start = time.perf_counter()
    for text in texts:
        why = dedupe.duplicate(text)
        if why is None:
            kept.append(text)
            continue
        reasons[why] = reasons.get(why, 0) + 1
        if why == "near duplicate":
            near.append(text)
    seconds = time.perf_counter() - start
    similar = []
    for text in near:  # the exact similarity to the kept text it was matched to
        grams, other = shingles(normalized(text).split()), dedupe.match(text)
        similar.append(len(grams & other) / len(grams | other))
    precise = sum(s >= args.threshold for s in similar)

    rng = random.Random(0)
    long = [t for t in kept if len(normalized(t).split()) >= 12]
    picked = rng.sample(long, min(2000, len(long)))
    caught, near_edits, variant_similarity, false_calls = 0, 0, [], 0
    for text in picked:
        words = text.split()
        i = rng.randrange(len(words))
        variant = " ".join([*words[:i], "really", *words[i + 1 :], "please"])
        variant_similarity.append(jaccard(text, variant))
        if variant_similarity[-1] >= args.threshold:  # a near duplicate by the definition
            near_edits += 1
            caught += dedupe.duplicate(variant) == "near duplicate"
    spliced = 0
    for text in rng.sample(long, min(2000, len(long))):
        other = rng.choice(long)
        a, b = text.split(), other.split()
        # half of one kept text and half of another: similar to each, a duplicate of neither
        mixed = " ".join(a[: len(a) // 2] + b[len(b) // 2 :])
        if max(jaccard(mixed, text), jaccard(mixed, other)) < args.threshold:
            spliced += 1
            false_calls += dedupe.duplicate(mixed) is not None

    table = Table(title=f"duplicate detection, threshold {args.threshold}, {len(texts)} texts")
    for col in ("measure", "value"):
        table.add_column(col, justify="right")
    rows = {
        "texts": len(texts),
        "seconds": f"{seconds:.1f}",
        "texts/s": f"{len(texts) / seconds:.0f}",
        "kept": len(kept),
        **{f"dropped: {k}": v for k, v in sorted(reasons.items())},
        "near calls with exact similarity >= threshold": f"{precise}/{len(near)}",
        "their similarity, min / median": (
            f"{min(similar):.2f} / {sorted(similar)[len(similar) // 2]:.2f}" if similar else "-"
        ),
        "one-word edits at or above the threshold, caught": f"{caught}/{near_edits}",
        "edits' similarity, min / median": (
            f"{min(variant_similarity):.2f} / "
            f"{sorted(variant_similarity)[len(variant_similarity) // 2]:.2f}"
        ),
        "half-and-half splices called duplicates": f"{false_calls}/{spliced}",
    }
    for k, v in rows.items():
        table.add_row(k, str(v))
    Console(width=120).print(table)
    print(
        f"near_precision={precise / max(len(near), 1):.3f} "
        f"edit_recall={caught / max(near_edits, 1):.3f}"
    )
    print(f"dedupe_texts_per_s={len(texts) / seconds:.0f}")


if __name__ == "__main__":
    main()
