"""The recipe ablation's curves: the trainer's held-out replayed chain-3 tau against the
step, one line per variant, from docs/recipe-ablation.csv (the evaluations of
bench/recipe_ablation.py; each row names its card and commit).

    .venv/bin/python scripts/plot_recipe_ablation.py [--csv CSV] [--out PNG]
"""

from __future__ import annotations

from csv_figure import figure_for, grouped_rows, save


def main() -> None:
    args, fig, ax = figure_for("docs/recipe-ablation.csv", "docs/recipe-ablation.png")
    lines = grouped_rows(args.csv, lambda row: f"{row['variant']}: {row['overrides']}")
    for name, rows in lines.items():
        rows.sort(key=lambda r: int(r["step"]))
        x = [int(r["step"]) for r in rows]
        y = [float(r["chain_tau"]) for r in rows]
        ax.plot(x, y, marker="o", label=name)
        ax.annotate(f"{y[-1]:.3f}", (x[-1], y[-1]), fontsize=8, textcoords="offset points",
                    xytext=(6, -3))  # fmt: skip
    first = next(iter(lines.values()))[0]
    ax.set_xlim(right=ax.get_xlim()[1] * 1.08)  # room for the last labels
    ax.set_xlabel("optimizer step (668 a epoch)")
    ax.set_ylabel("held-out chain-3 tau, replayed")
    ax.set_title(
        f"recipe ablation on 15,704 conversations, {first['heldout_samples']} held out "
        f"({first['card'].split(',')[0]}, {first['commit']})"
    )
    save(fig, ax, args.out, dpi=110)


if __name__ == "__main__":
    main()
