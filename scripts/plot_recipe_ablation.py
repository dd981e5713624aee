"""The recipe ablations' curves: the trainer's held-out replayed chain-3 tau against the
step, one line per variant and one panel per ablation (the commit it ran), from
docs/recipe-ablation.csv (the evaluations of bench/recipe_ablation.py; each row names its
card and commit).

    .venv/bin/python scripts/plot_recipe_ablation.py [--csv CSV] [--out PNG]
"""

from __future__ import annotations

from csv_figure import arguments, blank_figure, grouped, grouped_rows, save

# the train keys the legend abbreviates, so that a variant of several fits a panel
SHORT_KEYS = {
    "train.": "",
    "draft_intermediate_size": "mlp",
    "target_temperature": "T",
    "ttt_steps": "ttt",
}


def short(overrides: str) -> str:
    for key, abbreviation in SHORT_KEYS.items():
        overrides = overrides.replace(key, abbreviation)
    return overrides


def shared_card(cards: list[str]) -> str:
    """The leading comma-separated parts every row's card names ("H100 80GB, bf16" of a
    panel whose variants ran side by side and alone)."""
    shared = []
    for parts in zip(*(card.split(", ") for card in cards), strict=False):
        if len(set(parts)) > 1:
            break
        shared.append(parts[0])
    return ", ".join(shared)


def main() -> None:
    args = arguments("docs/recipe-ablation.csv", "docs/recipe-ablation.png")
    ablations = grouped_rows(args.csv, lambda row: row["commit"])
    fig, axes = blank_figure(panels=len(ablations))
    for ax, (commit, rows) in zip(axes, ablations.items(), strict=True):
        lines = grouped(rows, lambda row: f"{row['variant']}: {short(row['overrides'])}")
        for name, points in lines.items():
            points.sort(key=lambda r: int(r["step"]))
            x = [int(r["step"]) for r in points]
            y = [float(r["chain_tau"]) for r in points]
            ax.plot(x, y, marker="o", label=name)
            ax.annotate(f"{y[-1]:.3f}", (x[-1], y[-1]), fontsize=8, textcoords="offset points",
                        xytext=(6, -3))  # fmt: skip
        first = rows[0]
        ax.set_xlim(right=ax.get_xlim()[1] * 1.1)  # room for the last labels
        ax.set_xlabel("optimizer step (668 a epoch)")
        card = shared_card([row["card"] for row in rows])
        ax.set_title(f"{first['heldout_samples']} held out; {card}; {commit}", fontsize=9)
    axes[0].set_ylabel("held-out chain-3 tau, replayed")
    fig.suptitle("recipe ablations on the kept 15,704 conversations, 2 epochs", fontsize=10)
    save(fig, axes, args.out, dpi=110, legend_at="lower right")  # below the rising lines


if __name__ == "__main__":
    main()
