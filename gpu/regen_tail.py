"""How much of local regeneration's batching is part-full at the source's end (a simulation:
no model runs).

Each conversation needs as many rounds as it has regenerable assistant turns (turns whose
history, at ~4 characters a token and `--reply` tokens a regenerated reply, is under
`--max-length`). A pool of `--pool` open conversations is served in rounds; a round cuts
every waiting turn into batches of `--batch`, and a finished conversation's place goes to
the next one of the source. With the graphed decoder a batch costs the same whatever its
rows, so batches are the cost. Prints a table per conversation order, then
`longest_first_saving=` (the share of batches that ordering the longest first saves).

    .venv/bin/python gpu/regen_tail.py [--source sharegpt] [--pool 1024] [--batch 512]
"""

from __future__ import annotations

import argparse
import random

from rich.console import Console
from rich.table import Table

from eagletrain.data.conversations import read_records


def regenerable_turns(source: str, max_length: int, reply: int) -> list[int]:
    turns = []
    for record in read_records(source, "auto", "skip"):
        if record.rejected or not record.messages:
            continue
        history = count = 0
        for message in record.messages:
            if message["role"] == "assistant":
                if history >= max_length:
                    break
                count += 1
                history += reply
            else:
                history += len(message.get("content") or "") // 4
        if count:
            turns.append(count)
    return turns


def simulate(order: list[int], pool: int, batch: int) -> tuple[int, int, float]:
    """Batches, part-full batches, and the share of batch rows used."""
    source = iter(order)
    open_ = [n for n in (next(source, None) for _ in range(pool)) if n is not None]
    batches = part_full = rows = 0
    while open_:
        waiting = len(open_)
        cut = -(-waiting // batch)
        batches += cut
        rows += waiting
        part_full += waiting % batch != 0
        following = []
        for n in open_:
            if n > 1:
                following.append(n - 1)
            elif (m := next(source, None)) is not None:
                following.append(m)
        open_ = following
    return batches, part_full, rows / (batches * batch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", default="sharegpt")
    parser.add_argument("--pool", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--reply", type=int, default=200, help="tokens a regenerated reply")
    args = parser.parse_args()

    turns = regenerable_turns(args.source, args.max_length, args.reply)
    shuffled = turns[:]
    random.Random(0).shuffle(shuffled)
    orders = {
        "source order": turns,
        "shuffled": shuffled,
        "longest first": sorted(turns, reverse=True),
    }
    table = Table(
        title=f"{len(turns)} conversations, {sum(turns)} turns (at most {max(turns)} a "
        f"conversation), pool {args.pool}, batch {args.batch}"
    )
    for col in ("order", "batches", "part-full batches", "rows used"):
        table.add_column(col, justify="right")
    results = {name: simulate(order, args.pool, args.batch) for name, order in orders.items()}
    for name, (batches, part_full, used) in results.items():
        table.add_row(name, str(batches), str(part_full), f"{used:.3f}")
    Console(width=120).print(table)
    saving = 1 - results["longest first"][0] / results["source order"][0]
    print(f"longest_first_saving={saving:.3f}")


if __name__ == "__main__":
    main()
