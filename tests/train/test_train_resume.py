"""kill -9 in the middle of training, then resume: the loss curve is the one an
uninterrupted run produces, step for step (model, optimizer, scheduler, RNG and data
position all come back from the checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import cli_env, eagletrain, eagletrain_background, status_json, train_losses, wait_for


def _prepare(config: Path, run: Path) -> None:
    for stage in ("data", "extract"):
        result = eagletrain(stage, config, "--run-dir", run)
        assert result.returncode == 0, result.stderr


def _straight_and_other(config: Path, tmp_path: Path, overrides: list[str], other: str):
    """Two prepared runs: `straight` trained without interruption, `other` not yet (a copy
    of the prepared one: a run directory is relocatable)."""
    runs = tmp_path / "straight", tmp_path / other
    _prepare(config, runs[0])
    shutil.copytree(runs[0], runs[1])
    assert eagletrain("train", config, "--run-dir", runs[0], *overrides).returncode == 0
    return runs


def _assert_same_losses(straight: Path, other: Path) -> None:
    expected, got = train_losses(straight), train_losses(other)
    assert sorted(got) == sorted(expected)
    for step, loss in expected.items():
        assert abs(got[step] - loss) <= 1e-6 * max(1.0, abs(loss)), (step, got[step], loss)


def test_kill_during_training_resumes_to_the_same_loss_curve(tiny_config: Path, tmp_path: Path):
    overrides = ["--set", "train.checkpoint_every=3", "--set", "train.epochs=3"]
    straight, killed = _straight_and_other(tiny_config, tmp_path, overrides, "killed")

    env = cli_env(EAGLETRAIN_FAULT_DELAY="train:0.3")
    proc = eagletrain_background(
        "train", tiny_config, "--run-dir", killed, *overrides, env=env, log=tmp_path / "t.log"
    )
    try:
        wait_for(lambda: status_json(killed)["train"]["done"] >= 7)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert status_json(killed)["train"]["verdict"] == "dead"

    resumed = eagletrain("train", tiny_config, "--run-dir", killed, *overrides)
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_losses(straight, killed)
    evals = [_evaluations(run) for run in (straight, killed)]
    assert [s for s, _ in evals[0]] == [s for s, _ in evals[1]]
    for (_, want), (_, have) in zip(*evals, strict=True):
        assert abs(want - have) <= 1e-6
    # each evaluation's per-row figures once, as in metrics.jsonl
    rows = [
        (run / "train" / "heldout_rows.jsonl").read_text().splitlines()
        for run in (straight, killed)
    ]
    assert [[json.loads(r)["step"] for r in lines] for lines in rows] == [
        [s for s, _ in evals[0]]
    ] * 2


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_training_after_the_step_in_flight(
    tiny_config: Path, tmp_path: Path, sig: signal.Signals
):
    """No periodic checkpoint falls before the signal, so resuming from where it stopped (not
    from step 0) proves the stop saved the step in flight; the curve is then unchanged."""
    overrides = ["--set", "train.checkpoint_every=0", "--set", "train.epochs=3"]
    straight, stopped = _straight_and_other(tiny_config, tmp_path, overrides, "stopped")

    env = cli_env(EAGLETRAIN_FAULT_DELAY="train:0.3")
    log = tmp_path / "t.log"
    proc = eagletrain_background(
        "train", tiny_config, "--run-dir", stopped, *overrides, env=env, log=log
    )
    try:
        wait_for(lambda: status_json(stopped)["train"]["done"] >= 4)
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=60) == 130, log.read_text()
    finally:
        proc.kill()
    train = status_json(stopped)["train"]
    assert train["verdict"] == "stopped", train
    saved = sorted(p.name for p in (stopped / "train").glob("resume-*"))
    assert saved == [f"resume-{train['done']:08d}"], saved
    assert len(train_losses(stopped)) == train["done"]

    resumed = eagletrain("train", tiny_config, "--run-dir", stopped, *overrides, env=cli_env())
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_losses(straight, stopped)


def _evaluations(run: Path) -> list[tuple[int, float]]:
    lines = (run / "train" / "metrics.jsonl").read_text().splitlines()
    return [
        (r["step"], r["eval"]["simulated_acceptance_length"])
        for r in map(json.loads, lines)
        if "eval" in r
    ]


def test_best_heldout_evaluation_selects_the_checkpoint(tiny_config: Path, tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    _prepare(tiny_config, run)
    overrides = ["--set", "train.epochs=3", "--set", "train.eval_every=2"]
    overrides += ["--set", "train.draft_intermediate_size=96"]  # the target's is 128
    result = eagletrain("train", tiny_config, "--run-dir", run, *overrides)
    assert result.returncode == 0, result.stderr
    steps = sorted(train_losses(run))
    per_epoch = len(steps) // 3
    evals = _evaluations(run)
    expected = sorted({s for s in steps if s % 2 == 0} | {per_epoch * e for e in (1, 2, 3)})
    assert [s for s, _ in evals] == expected
    best_step, best_tau = max(evals, key=lambda e: (e[1], -e[0]))
    summary = json.loads((run / "train" / "checkpoint" / "train_summary.json").read_text())
    assert summary["steps"] == best_step
    assert summary["simulated_acceptance_length"] == best_tau
    config = json.loads((run / "train" / "checkpoint" / "drafter_config.json").read_text())
    assert config["intermediate_size"] == 96
    # each evaluation's replayed chain tau comes with its bootstrap interval over rows, and
    # its rows' own (tokens, cycles) sum to it
    lines = (run / "train" / "heldout_rows.jsonl").read_text().splitlines()
    per_step = {r["step"]: r["rows"] for r in map(json.loads, lines)}
    assert sorted(per_step) == expected
    for record in map(json.loads, (run / "train" / "metrics.jsonl").read_text().splitlines()):
        if "eval" in record:
            figures = record["eval"]
            low, high = figures["chain_tau_ci"]
            assert 1.0 <= low <= figures["chain_tau"] <= high, figures
            rows = per_step[record["step"]]
            assert figures["chain_rows"] == len(rows) >= 1
            assert figures["chain_cycles"] == sum(c for _, c in rows)
            tau = sum(t for t, _ in rows) / figures["chain_cycles"]
            assert tau == pytest.approx(figures["chain_tau"])

    board = EventAccumulator(str(run / "train" / "tensorboard"))
    board.Reload()
    tags = board.Tags()["scalars"]
    assert {"train/loss", "train/acc_0", "heldout/simulated_acceptance_length"} <= set(tags)
    assert [e.step for e in board.Scalars("train/loss")] == steps


def test_an_unfinished_run_exports_its_best_or_its_latest_weights(
    tiny_config: Path, tmp_path: Path
):
    """Stopped after its first held-out evaluation: export takes the evaluated checkpoint
    by default and the exact-resume state's newer weights with export.weights=latest."""
    from safetensors.torch import load_file

    from eagletrain.export import load_exported

    run = tmp_path / "run"
    _prepare(tiny_config, run)
    overrides = ["--set", "train.checkpoint_every=0", "--set", "train.epochs=3"]
    env = cli_env(EAGLETRAIN_FAULT_DELAY="train:0.3")
    log = tmp_path / "t.log"
    proc = eagletrain_background(
        "train", tiny_config, "--run-dir", run, *overrides, env=env, log=log
    )
    try:
        metrics = run / "train" / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and _evaluations(run))
        evaluated = _evaluations(run)[0][0]
        wait_for(lambda: status_json(run)["train"]["done"] >= evaluated + 2)
        os.kill(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 130, log.read_text()
    finally:
        proc.kill()
    (resume,) = (run / "train").glob("resume-*")
    stopped_at = int(resume.name.split("-")[1])
    assert stopped_at > evaluated
    shutil.copytree(run, tmp_path / "latest")

    def exported(run_dir: Path, *sets: str) -> tuple[dict, str]:
        args = ("--run-dir", run_dir, "--allow-partial", *overrides, *sets)
        result = eagletrain("export", tiny_config, *args)
        assert result.returncode == 0, result.stderr
        return load_exported(run_dir / "export" / "sglang").state_dict(), result.stdout

    best, out = exported(run)
    assert f"weights: train/checkpoint (step {evaluated}, best held-out evaluation)" in out
    assert f"step {stopped_at} is saved too" in out
    latest, out = exported(tmp_path / "latest", "--set", "export.weights=latest")
    assert f"weights: train/{resume.name} (step {stopped_at}, not evaluated)" in out
    for weights, directory in ((best, run / "train" / "checkpoint"), (latest, resume)):
        saved = load_file(directory / "model.safetensors")
        assert all(torch.equal(weights[k], saved[k].to(weights[k].dtype)) for k in saved)
    assert not all(torch.equal(best[k], latest[k]) for k in best)
