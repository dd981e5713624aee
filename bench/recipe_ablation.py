"""Which recipe lever still pays: one run's data, trained once per variant of the recipe
(TTT steps, lr, epochs, draft vocabulary: any `--set` of the train section), side by side
on one GPU, each judged by the trainer's own held-out evaluations (at every epoch's end and
every `train.eval_every` steps: the served chain of `eval.draft_steps` drafts replayed on
the held-out replies, `chain_tau`, and the simulated acceptance length over all TTT steps).

Each variant trains a copy of RUN_DIR (a run whose data stage is done and whose training
has not started) under torchrun, all at once (a 135M target leaves an H100 mostly idle
between kernels) or `--parallel` at a time. After `--seconds` each gets SIGINT and saves
its step in flight: the same command again resumes every copy where it stopped.

    python bench/recipe_ablation.py RUN_DIR --variant "base:" \\
        --variant "ttt3:train.ttt_steps=3" --variant "lr1e-3:train.lr=1e-3" \\
        [--set target.model=PATH] [--seconds 500] [--parallel 4] [--out DIR]

Prints a table, then `chain_tau_ratio_best=<ratio>` last: the best variant's held-out
chain tau against the first variant's (the baseline) at the last evaluation both reached.
The table also pairs each variant with the first on the same held-out rows (each
evaluation's per-row figures, train/heldout_rows.jsonl): a ratio with its 95% interval.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from eagletrain.config import load_config
from eagletrain.decode.acceptance import paired_tau_ratio
from eagletrain.report import read_metrics
from eagletrain.runtime.ledger import Ledger
from eagletrain.runtime.rundir import CONFIG_NAME
from eagletrain.runtime.status import stage_status
from eagletrain.target import resolve_target
from eagletrain.train.log import HELDOUT_ROWS


@dataclass
class Variant:
    name: str
    overrides: list[str]
    directory: Path = field(default=Path())

    @classmethod
    def parse(cls, spec: str) -> Variant:
        name, _, sets = spec.partition(":")
        if not name:
            raise SystemExit(f"--variant {spec!r}: expected NAME:key=value key=value ...")
        return cls(name, sets.split())


def prepare(run_dir: Path, variant: Variant, out: Path) -> None:
    """A copy of the run for the variant (kept between calls: a rerun resumes it)."""
    variant.directory = out / variant.name
    if variant.directory.is_dir():
        return
    if (run_dir / "train").exists():
        raise SystemExit(f"{run_dir}: training has started there; ablate a run before it")
    shutil.copytree(run_dir, out / f".{variant.name}.tmp", dirs_exist_ok=True)
    (out / f".{variant.name}.tmp").rename(variant.directory)


def launch(variant: Variant, base: list[str], port: int, threads: int) -> subprocess.Popen:
    sets = [arg for s in [*base, *variant.overrides] for arg in ("--set", s)]
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
        "--master_port", str(port), "-m", "eagletrain", "train",
        str(variant.directory / CONFIG_NAME), "--run-dir", str(variant.directory),
        *sets, "--allow-partial",
    ]  # fmt: skip
    # the host's cores shared out: trainers side by side each spinning every core's
    # thread pool slow each other down
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with (variant.directory / "ablation.log").open("a") as log:  # the child keeps its copy
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)


def steps_logged(variant: Variant) -> int:
    path = variant.directory / "train" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def dump_and_stop(variant: Variant, proc: subprocess.Popen) -> None:
    """A trainer with no step by the stall limit: its worker's stacks into its log
    (SIGUSR1, eagletrain's faulthandler), then a stop."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    for pid in children.read_text().split() if children.is_file() else []:
        os.kill(int(pid), signal.SIGUSR1)
    time.sleep(2)
    print(f"{variant.name}: no step after the stall limit; stacks in "
          f"{variant.directory / 'ablation.log'}", flush=True)  # fmt: skip
    proc.send_signal(signal.SIGINT)


def train_all(
    variants: list[Variant], base: list[str], seconds: float, parallel: int, stall: float
) -> list[Variant]:
    """Each variant until its training ends or `seconds` after its start (then SIGINT);
    one with no step logged `stall` seconds after its start is stopped. Returns those.
    Trainers due together are signalled together and share one grace period: stopped one
    after another, each waited for in turn, the last ones trained on past their time and
    the whole ablation overran a device call's limit (2026-12-07)."""
    waiting, running, stalled = list(variants), [], []
    threads = max(1, (os.cpu_count() or 1) // parallel)
    while waiting or running:
        while waiting and len(running) < parallel:
            variant = waiting.pop(0)
            port = 29700 + variants.index(variant)
            proc = launch(variant, base, port, threads)
            running.append((variant, proc, time.monotonic()))
        stopping = []
        for entry in list(running):
            variant, proc, started = entry
            age = time.monotonic() - started
            if proc.poll() is not None:
                running.remove(entry)
            elif age > stall and variant not in stalled and not steps_logged(variant):
                stalled.append(variant)
                dump_and_stop(variant, proc)
                stopping.append(entry)
            elif age > seconds:
                proc.send_signal(signal.SIGINT)
                stopping.append(entry)
        _wait_or_kill([proc for _, proc, _ in stopping], grace=60.0)
        for entry in stopping:
            running.remove(entry)
        time.sleep(1)
    return stalled


def _wait_or_kill(procs: list[subprocess.Popen], grace: float) -> None:
    """Wait for signalled trainers to save and exit, all within one `grace` period; kill
    those still running after it."""
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def figures(variant: Variant) -> dict:
    """Steps done and total, seconds a step, and the held-out evaluations."""
    train = stage_status(Ledger(variant.directory, create=False), "train")
    steps, evals = read_metrics(variant.directory / "train" / "metrics.jsonl")
    gaps = [b["time"] - a["time"] for a, b in itertools.pairwise(steps)]
    return {
        "done": train.done,
        "total": train.total,
        "step_s": statistics.median([g for g in gaps if g > 0]) if gaps else float("nan"),
        "evals": [(r["step"], r["eval"]) for r in evals],
    }


def heldout_rows(variant: Variant) -> dict[int, list[tuple[int, int]]]:
    """Each evaluation's per-row replayed chain (tokens, cycles), by step."""
    path = variant.directory / "train" / HELDOUT_ROWS
    lines = path.read_text().splitlines() if path.is_file() else []
    return {r["step"]: r["rows"] for r in map(json.loads, lines)}


def paired_against(base: Variant, variant: Variant) -> str:
    """The variant's chain tau against the base's at the last step both evaluated, paired
    over the same held-out rows, with its 95% interval."""
    mine, theirs = heldout_rows(variant), heldout_rows(base)
    common = sorted(set(mine) & set(theirs))
    if not common:
        return "-"
    step = common[-1]
    ratio, low, high = paired_tau_ratio(theirs[step], mine[step])
    return f"{ratio:.3f}x [{low:.3f}-{high:.3f}] @{step}"


def report(variants: list[Variant]) -> None:
    results = {v.name: figures(v) for v in variants}
    base = results[variants[0].name]
    table = Table(title="recipe ablation: held-out evaluations (epoch ends, train.eval_every)")
    for column in (
        "variant", "overrides", "steps", "s/step", "chain tau @ step",
        "last chain tau [95% CI over rows]", "simulated tau",
        "acc_0", "held-out samples", "chain tau vs first",
        "paired vs first [95% CI]",
    ):  # fmt: skip
        table.add_column(column)
    ratios = {}
    for variant in variants:
        r = results[variant.name]
        evals = r["evals"]
        last = evals[-1][1] if evals else {}
        common = min(len(evals), len(base["evals"]))
        if common:
            ratio = evals[common - 1][1]["chain_tau"] / base["evals"][common - 1][1]["chain_tau"]
            ratios[variant.name] = ratio
        table.add_row(
            variant.name,
            " ".join(variant.overrides) or "(the config's)",
            f"{r['done']}/{r['total']}",
            f"{r['step_s']:.3f}",
            " / ".join(f"{e['chain_tau']:.3f} @{step}" for step, e in evals) or "-",
            _with_interval(last),
            f"{last['simulated_acceptance_length']:.3f}" if last else "-",
            f"{last['heldout_acc'][0]:.3f}" if last else "-",
            str(last.get("heldout_samples", "-")),
            f"{ratios[variant.name]:.3f}x (evaluation {common})" if common else "-",
            paired_against(variants[0], variant),
        )
    Console(width=200).print(table)
    others = {k: v for k, v in ratios.items() if k != variants[0].name}
    if others:
        best = max(others, key=others.__getitem__)
        print(f"best variant: {best}")
        print(f"chain_tau_ratio_best={others[best]:.3f}")


def _with_interval(figures: dict) -> str:
    """The chain tau with its interval and rows (evaluations since 2026-12-07 carry one)."""
    if "chain_tau_ci" not in figures:
        return f"{figures['chain_tau']:.3f}" if figures else "-"
    low, high = figures["chain_tau_ci"]
    return f"{figures['chain_tau']:.3f} [{low:.3f}-{high:.3f}], {figures['chain_rows']} rows"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--variant", action="append", required=True, type=Variant.parse)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--seconds", type=float, default=500.0)
    parser.add_argument("--parallel", type=int, default=0, help="0: all at once")
    parser.add_argument("--out", type=Path, default=None, help="default RUN_DIR.ablation")
    parser.add_argument(
        "--stall-seconds", type=float, default=300.0,
        help="a variant with no step logged by then is stopped, its stacks in its log",
    )  # fmt: skip
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    out = args.out or args.run_dir.with_name(args.run_dir.name + ".ablation")
    out.mkdir(parents=True, exist_ok=True)
    for variant in args.variant:
        prepare(args.run_dir, variant, out)
    if not args.report_only:
        # the target resolved once (a GGUF de-quantized into the cache) before the
        # trainers start, not by each of them at once
        resolve_target(load_config(args.run_dir / CONFIG_NAME, args.sets).target)
        parallel = args.parallel or len(args.variant)
        stalled = train_all(args.variant, args.sets, args.seconds, parallel, args.stall_seconds)
        for variant in stalled:
            tail = (variant.directory / "ablation.log").read_text(errors="replace")[-4000:]
            print(f"--- {variant.name}: the end of its log\n{tail}", flush=True)
    report(args.variant)


if __name__ == "__main__":
    main()
