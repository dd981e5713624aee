"""How long `eagletrain status` takes on big ledgers: 1,000,000 items, and one shaped like
the run we started from (37,312 items, 18,420 done). Goal: < 0.1 s.

    .venv/bin/python bench/status.py [--items 1000000]

Prints a table (in-process status and the full CLI command), then `status_s=<x>` last:
the in-process time at the largest size (median of 20)."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagletrain.runtime.ledger import Ledger
from eagletrain.runtime.status import run_status
from eagletrain.runtime.worker import process_start_time


def build(run_dir: Path, items: int, done: int) -> None:
    """A ledger mid-extraction: `done` of `items` finished over the last hour, a live worker."""
    ledger = Ledger(run_dir, create=True)
    now = time.time()
    for stage, total in (("data", items), ("extract", items)):
        ledger.begin_stage(stage, "items", total, "samples")
        with ledger.transaction() as c:
            c.executemany(
                "INSERT INTO items(stage, key, ord, state, tokens, shard, offset, checksum, "
                "finished_at) VALUES(?,?,?,?,?,?,?,?,?)",
                (
                    (
                        stage,
                        f"{i:024x}",
                        i,
                        "done" if stage == "data" or i < done else "pending",
                        2353,
                        f"shard-{i // 64:06d}",
                        0,
                        "0" * 32,
                        now - 3600 + 3600 * i / max(done, 1),
                    )
                    for i in range(total)
                ),
            )
    with ledger.transaction() as c:
        c.executemany(
            "INSERT INTO progress VALUES('extract', ?, ?)",
            ((now - 3600 + t, int(done * t / 3600)) for t in range(0, 3601, 2)),
        )
        c.execute(
            "INSERT INTO workers(id, stage, partition_, pid, pid_start, host, started_at, "
            "heartbeat_at, progress_at, state) VALUES('w', 'extract', '0/1', ?, ?, ?, ?, ?, ?, "
            "'running')",
            (
                os.getpid(),
                process_start_time(os.getpid()),
                socket.gethostname(),
                now - 3600,
                now,
                now,
            ),
        )
    ledger.complete("data", items, items * 2353, "x", False, {})
    ledger.close()


def time_status(run_dir: Path, repeats: int = 20) -> tuple[float, float, str]:
    ledger = Ledger(run_dir)
    ledger.conn.execute("UPDATE workers SET heartbeat_at=?", (time.time(),))
    ledger.close()
    in_process = []
    for _ in range(repeats):
        start = time.perf_counter()
        stages = run_status(run_dir)
        in_process.append(time.perf_counter() - start)
    cli = []
    for _ in range(3):
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "eagletrain", "status", str(run_dir)],
            check=True,
            capture_output=True,
        )
        cli.append(time.perf_counter() - start)
    extract = next(s for s in stages if s.stage == "extract")
    return (
        statistics.median(in_process),
        statistics.median(cli),
        (f"{extract.verdict} {extract.done}/{extract.total} eta {extract.eta_s:.0f}s"),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=1_000_000)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for items, done in ((37_312, 18_420), (args.items, args.items // 2)):
            run_dir = Path(tmp) / f"run-{items}"
            run_dir.mkdir()
            start = time.perf_counter()
            build(run_dir, items, done)
            built = time.perf_counter() - start
            in_process, cli, seen = time_status(run_dir)
            size = (run_dir / "ledger.sqlite").stat().st_size / 2**20
            rows.append((items, done, built, size, in_process, cli, seen))
    print(
        f"{'items':>9} {'done':>8} {'build_s':>8} {'ledger_MiB':>10} {'status_s':>9} "
        f"{'cli_s':>6}  verdict"
    )
    for items, done, built, size, in_process, cli, seen in rows:
        print(
            f"{items:>9} {done:>8} {built:>8.1f} {size:>10.1f} {in_process:>9.4f} "
            f"{cli:>6.2f}  {seen}"
        )
    print(f"status_s={rows[-1][4]:.4f}")


if __name__ == "__main__":
    main()
