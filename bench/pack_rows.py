"""Packing a run's training samples into rows (train/packing.py), the step every training
call pays before its first step: the max-tree first fit against the plain scan of every
row it replaced (the same-run baseline), on the real sample lengths of a run directory's
data stage. Both must give the same rows (a resumed run must see the same batches).

Prints a table, then `pack_speedup=<scan s / tree s>` last.

    python bench/pack_rows.py RUN_DIR [--row-tokens 1024]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from eagletrain.runtime.ledger import Ledger
from eagletrain.train.packing import pack_rows

# the plain scan is the test's reference (tests/train/test_packing.py): one copy
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "train"))
from test_packing import first_fit_by_scan


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--row-tokens", type=int, default=1024)
    args = parser.parse_args()
    items = Ledger(args.run_dir).items("data", "done")
    lengths = [int(i.tokens or 0) for i in items if i.split != "heldout"]
    table = Table(title=f"{len(lengths):,} training samples into rows of {args.row_tokens}")
    for column in ("packing", "rows", "fill", "seconds"):
        table.add_column(column, justify="right")
    results = {}
    for name, pack in (("scan (before)", first_fit_by_scan), ("max-tree", pack_rows)):
        start = time.perf_counter()
        rows = pack(lengths, args.row_tokens)
        results[name] = (rows, time.perf_counter() - start)
        fill = sum(lengths) / (args.row_tokens * len(rows))
        table.add_row(name, f"{len(rows):,}", f"{fill:.3f}", f"{results[name][1]:.2f}")
    Console().print(table)
    (scan, scan_s), (tree, tree_s) = results.values()
    print(f"same rows: {scan == tree}")
    print(f"pack_speedup={scan_s / tree_s:.1f}")


if __name__ == "__main__":
    main()
