"""What the docs' plotting scripts share: `--csv` / `--out` arguments, the CSV's rows grouped
into one line each, and a headless matplotlib figure saved with a grid and legend."""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def arguments(default_csv: str, default_out: str) -> argparse.Namespace:
    """`--csv` and `--out`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", type=Path, default=Path(default_csv))
    parser.add_argument("--out", type=Path, default=Path(default_out))
    return parser.parse_args()


def blank_figure(panels: int = 1) -> tuple[Any, list[Any]]:
    """(figure, axes): `panels` empty plots side by side sharing the y axis (one: 8 x 4.5
    inches)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = (8, 4.5) if panels == 1 else (6 * panels, 4.5)
    fig, axes = plt.subplots(1, panels, figsize=size, sharey=True, squeeze=False)
    return fig, list(axes[0])


def figure_for(default_csv: str, default_out: str) -> tuple[argparse.Namespace, Any, Any]:
    """(arguments, figure, axes): `--csv` and `--out`, and an empty 8 x 4.5 inch plot."""
    fig, (ax,) = blank_figure()
    return arguments(default_csv, default_out), fig, ax


def grouped(rows: Iterable[dict], key: Callable[[dict], str]) -> dict[str, list[dict]]:
    """The rows by `key`, each group in the rows' order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return groups


def grouped_rows(path: Path, line: Callable[[dict[str, str]], str]) -> dict[str, list[dict]]:
    """The CSV's rows by the name of the line each belongs to, in file order."""
    with path.open() as f:
        return grouped(csv.DictReader(f), line)


def save(fig: Any, ax: Any, out: Path, dpi: int, legend_at: str = "best") -> None:
    """Grid and legend (at `legend_at`, a matplotlib location) on each of the axes (one, or
    a list), then the PNG."""
    for each in ax if isinstance(ax, list) else [ax]:
        each.grid(alpha=0.3)
        each.legend(fontsize=8, loc=legend_at)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    print(f"wrote {out}")
