"""`eagletrain report RUN_DIR`: a Markdown report with PNG plots (matplotlib), written to
RUN_DIR/report/ from what the run recorded: train/metrics.jsonl (loss and accuracy per TTT
step, held-out simulated tau), eval/results.json and eval/bench-*.json (tau per dataset
against prompt lookup, per-position acceptance) and the ledger (stage timings)."""

from __future__ import annotations

import json
from math import nan
from pathlib import Path
from typing import Any

from eagletrain.errors import InputError
from eagletrain.runtime.rundir import Run
from eagletrain.stages import STAGES


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    steps, evals = [], []
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                (evals if "eval" in record else steps).append(record)
    return steps, evals


def eval_results(run: Run) -> list[dict[str, Any]]:
    """The eval stage's results, then any bench/decode.py results saved in the run."""
    found = []
    for path in [run.dir / "eval" / "results.json", *sorted(run.dir.glob("eval/bench-*.json"))]:
        if path.is_file():
            saved = json.loads(path.read_text())
            # results.json holds one result per dataset; a bench file holds one
            for result in saved.get("results", [saved]):
                found.append({"file": path.name, **result})
    return found


def plot_training(steps: list[dict], evals: list[dict], out: Path) -> None:
    plt = _pyplot()
    ttt = len([k for k in steps[0] if k.startswith("loss_")])
    x = [r["step"] for r in steps]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for k in range(ttt):
        axes[0].plot(x, [r[f"loss_{k}"] for r in steps], label=f"step {k}", lw=1)
        axes[1].plot(x, [r[f"acc_{k}"] for r in steps], label=f"step {k}", lw=1)
    axes[0].set(title="training loss per TTT step", xlabel="optimizer step", ylabel="loss")
    axes[1].set(title="training accuracy per TTT step", xlabel="optimizer step", ylabel="acc")
    axes[1].set_ylim(0, 1)
    for ax in axes[:2]:
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
    if evals:
        at = [e["step"] for e in evals]
        simulated = [e["eval"]["simulated_acceptance_length"] for e in evals]
        axes[2].plot(at, simulated, marker="o", label="simulated, 7 steps")
        replayed = [e for e in evals if "chain_tau" in e["eval"]]
        if replayed:
            label = f"served chain {replayed[-1]['eval']['chain_steps']}, replayed"
            axes[2].plot(
                [e["step"] for e in replayed],
                [e["eval"]["chain_tau"] for e in replayed],
                marker="s",
                label=label,
            )
        axes[2].legend(fontsize=8)
    axes[2].set(
        title="held-out acceptance length",
        xlabel="optimizer step",
        ylabel="tau",
    )
    axes[2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _label(result: dict[str, Any]) -> str:
    source = "eval" if result.get("file") == "results.json" else "bench"
    name = Path(str(result.get("dataset", "?"))).name.split(".")[0]
    engine = result.get("engine", "eager")
    return f"{source}: {name}\nT={result.get('temperature', 0):g}, {engine}"


def plot_tau(results: list[dict[str, Any]], out: Path) -> None:
    plt = _pyplot()
    labels = [_label(r) for r in results]
    series = {"EAGLE chain": [r["tau"] for r in results]}
    if any("tree" in r for r in results):  # results from before tree decoding have none
        series["EAGLE tree"] = [r["tree"]["tau"] if "tree" in r else nan for r in results]
    series["prompt lookup"] = [r.get("prompt_lookup_tau") or nan for r in results]
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(labels) + 3), 4.2))
    width = 0.8 / len(series)
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=["" if v != v else f"{v:.2f}" for v in values], fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set(title="acceptance length (tau, pooled, bonus token included)", ylabel="tau")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_acceptance(result: dict[str, Any], out: Path) -> None:
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    chain = result["per_position_acceptance"]
    ax.plot(range(1, len(chain) + 1), chain, marker="o", label="chain")
    tree = result.get("tree", {}).get("per_position_acceptance")
    if tree:
        ax.plot(range(1, len(tree) + 1), tree, marker="s", label="dynamic tree")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(
        title=f"per-position acceptance, {_label(result).replace(chr(10), ' ')}",
        xlabel="draft position j",
        ylabel="fraction of cycles accepting j tokens or more",
    )
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def stage_timings(run: Run) -> list[tuple[str, float]]:
    timings = []
    for stage in STAGES:
        row = run.ledger.stage_row(stage)
        if row and row.get("started_at"):
            end = row.get("finished_at") or row["started_at"]
            timings.append((stage, end - row["started_at"]))
    return timings


def plot_timings(timings: list[tuple[str, float]], out: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(timings) + 1.5))
    names = [s for s, _ in timings][::-1]
    values = [t for _, t in timings][::-1]
    bars = ax.barh(names, values)
    ax.bar_label(bars, fmt="%.0f s", fontsize=8)
    ax.set(title="stage wall time (ledger)", xlabel="seconds")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_report(run: Run) -> Path:
    out = run.dir / "report"
    out.mkdir(exist_ok=True)
    steps, evals = read_metrics(run.dir / "train" / "metrics.jsonl")
    results = eval_results(run)
    timings = stage_timings(run)
    if not steps and not results:
        raise InputError(f"{run.dir}: nothing to report (no training metrics, no eval results)")
    lines = [f"# eagletrain report: {run.config.run.name}", "", f"Run directory: `{run.dir}`", ""]
    if timings:
        plot_timings(timings, out / "stages.png")
        lines += ["## Stages", "", "| stage | wall s |", "|---|---:|"]
        lines += [f"| {s} | {t:.0f} |" for s, t in timings]
        lines += ["", "![stage timings](stages.png)", ""]
    if steps:
        plot_training(steps, evals, out / "training.png")
        last = steps[-1]
        lines += [
            "## Training",
            "",
            f"{len(steps)} optimizer steps; last loss {last['loss']:.4f}, acc_0 "
            f"{last['acc_0']:.3f}.",
        ]
        if evals:
            best = max(evals, key=lambda e: e["eval"]["simulated_acceptance_length"])
            figures = best["eval"]
            chain = (
                f"; chain-{figures['chain_steps']} cycles replayed on the same replies: tau "
                f"{figures['chain_tau']:.3f}"
                if "chain_tau" in figures
                else ""
            )
            lines.append(
                f"Best held-out simulated tau {figures['simulated_acceptance_length']:.3f} "
                f"at step {best['step']} (the checkpoint exported){chain}."
            )
        lines += ["", "![training curves](training.png)", ""]
    if results:
        plot_tau(results, out / "tau.png")
        with_tree = [r for r in results if "tree" in r]
        plot_acceptance((with_tree or results)[0], out / "acceptance.png")
        lines += [
            "## Speculative decoding",
            "",
            "tau: tokens per draft-verify cycle including the target's bonus token, pooled "
            "over all cycles of all prompts.",
            "",
            "| results | dataset | T | prompts | chain tau [95% CI] | tree tau "
            "| prompt-lookup tau | out-of-vocab cycles | chain speedup | tree speedup |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]

        def cell(value: float | None, form: str) -> str:
            return "-" if value is None else format(value, form)

        for r in results:
            tree = r.get("tree") or {}
            ci = r.get("tau_ci95")
            tau = f"{r['tau']:.3f}" + (f" [{ci[0]:.2f}-{ci[1]:.2f}]" if ci else "")
            lines.append(
                f"| {r['file']} | {Path(str(r.get('dataset'))).name} | {r['temperature']:g} "
                f"| {r['prompts']} | {tau} | {cell(tree.get('tau'), '.3f')} "
                f"| {cell(r.get('prompt_lookup_tau'), '.3f')} "
                f"| {cell(r.get('out_of_vocab_share'), '.1%')} "
                f"| {cell(r.get('speedup'), '.2f')}x | {cell(tree.get('speedup'), '.2f')}x |"
            )
        lines += ["", "![tau per dataset](tau.png)", "", "![acceptance](acceptance.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
