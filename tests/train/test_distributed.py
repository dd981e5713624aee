"""torchrun with 2 CPU processes (gloo) trains the same drafter as 1 process with the same
global batch, under DDP and under FSDP (fully_shard): each rank takes its share of every
global batch, losses are normalised by the global mask sums, gradients are averaged (DDP)
or reduce-scattered (FSDP). FSDP's exact-resume checkpoints survive a kill -9 of torchrun,
whose ranks die with it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_env, eagletrain, status_json, wait_for
from safetensors.torch import load_file

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children first found, then theirs)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def _kill_tree(proc: subprocess.Popen, also: list[int]) -> None:
    """SIGKILL torchrun, its ranks and `also` (cleanup, should a check above fail)."""
    for pid in [proc.pid, *_descendants(proc.pid), *also]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in "ZX"  # dead, waiting to be reaped


def _metrics(run: Path) -> list[dict]:
    lines = (run / "train" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_gloo_processes_equal_one_process(tiny_config: Path, tmp_path: Path, parallelism):
    single, double = tmp_path / "single", tmp_path / "double"
    for stage in ("data", "extract"):
        result = eagletrain(stage, tiny_config, "--run-dir", single)
        assert result.returncode == 0, result.stderr
    shutil.copytree(single, double)
    overrides = ["--set", "train.epochs=2", "--set", "train.batch_size=4"]
    overrides += ["--set", f"train.parallelism={parallelism}"]
    assert eagletrain("train", tiny_config, "--run-dir", single, *overrides).returncode == 0
    torchrun = [*TORCHRUN, "--master_port", "29531", "-m", "eagletrain"]
    result = subprocess.run(
        [*torchrun, "train", str(tiny_config), "--run-dir", str(double), *overrides],
        capture_output=True,
        text=True,
        env=cli_env(OMP_NUM_THREADS="1"),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]

    one, two = _metrics(single), _metrics(double)
    assert len(one) == len(two) and len(one) > 4
    for a, b in zip(one, two, strict=True):  # per-step records and the held-out evaluations
        assert a["step"] == b["step"]
        if "eval" in a:
            tau = a["eval"]["simulated_acceptance_length"]
            assert abs(tau - b["eval"]["simulated_acceptance_length"]) <= 1e-4 * tau
            assert b["eval"]["world_size"] == 2
            continue
        assert a["tokens"] == b["tokens"]
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * max(1.0, abs(a["loss"])), (a, b)
        assert abs(a["acc_0"] - b["acc_0"]) <= 1e-6
    assert sum("eval" in r for r in two) == 2  # one per epoch
    summaries = [
        json.loads((run / "train" / "checkpoint" / "train_summary.json").read_text())
        for run in (single, double)
    ]
    assert summaries[0]["steps"] == summaries[1]["steps"]  # the same best checkpoint
    w1 = load_file(single / "train" / "checkpoint" / "model.safetensors")
    w2 = load_file(double / "train" / "checkpoint" / "model.safetensors")
    assert w1.keys() == w2.keys()
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-4, rtol=1e-3), name
    assert json.loads(eagletrain("status", double, "--json").stdout)[2]["verdict"] == "done"


def test_fsdp_kill_and_resume_reaches_the_same_losses(tiny_config: Path, tmp_path: Path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for stage in ("data", "extract"):
        assert eagletrain(stage, tiny_config, "--run-dir", straight).returncode == 0
    shutil.copytree(straight, killed)
    overrides = ["--set", "train.epochs=2", "--set", "train.batch_size=4"]
    overrides += ["--set", "train.parallelism=fsdp", "--set", "train.checkpoint_every=2"]

    def torchrun(run: Path, port: int) -> list[str]:
        cli = ["-m", "eagletrain", "train", str(tiny_config), "--run-dir", str(run)]
        return [*TORCHRUN, "--master_port", str(port), *cli, *overrides]

    env = cli_env(OMP_NUM_THREADS="1")
    done = subprocess.run(torchrun(straight, 29533), capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    proc = subprocess.Popen(
        torchrun(killed, 29534),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cli_env(OMP_NUM_THREADS="1", EAGLETRAIN_FAULT_DELAY="train:0.4"),
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        wait_for(lambda: status_json(killed)["train"]["done"] >= 5, timeout=240)
        ranks = _descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # torchrun only: its ranks must die with it
        proc.wait()
        # gone, mid-run: nothing of the killed run writes beside the resumed one
        wait_for(lambda: all(_gone(pid) for pid in ranks), timeout=30)
    finally:
        _kill_tree(proc, ranks)
    assert len(ranks) == 2, ranks
    assert status_json(killed)["train"]["verdict"] != "done"
    resumed = subprocess.run(torchrun(killed, 29535), capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = {r["step"]: r["loss"] for r in _metrics(straight) if "eval" not in r}
    got = [r for r in _metrics(killed) if "eval" not in r]
    assert [r["step"] for r in got] == sorted(want)  # every step once
    for r in got:
        assert abs(r["loss"] - want[r["step"]]) <= 1e-5 * max(1.0, abs(want[r["step"]]))
