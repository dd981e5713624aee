"""`status` from the ledger alone: per-state counts kept by triggers, stalled vs running
for a paused worker, stopped (not failed) after SIGINT, stacks printed on SIGUSR1, and a
second operator refused with who holds the stage."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

from conftest import cli_env, eagletrain, eagletrain_background, status_json, wait_for

from eagletrain.runtime.ledger import Ledger


def test_counts_follow_item_states(tmp_path: Path):
    ledger = Ledger(tmp_path, create=True)
    ledger.plan_items("data", [(f"k{i}", i, None) for i in range(10)])
    ledger.plan_items("data", [(f"k{i}", i, None) for i in range(10)])  # idempotent
    ledger.mark_items(
        "data",
        "w",
        [{"key": "k1", "state": "done"}, {"key": "k2", "state": "skipped", "error": "x"}],
    )
    ledger.mark_items("data", "w", [{"key": "k1", "state": "done"}])  # same state again
    assert ledger.counts("data") == {"pending": 8, "done": 1, "skipped": 1}
    ledger.reset_items("data", ["k1"])
    assert ledger.counts("data") == {"pending": 9, "skipped": 1}
    assert ledger.error_reasons("data") == {"skipped: x": 1}


def _start_slow_extract(tiny_config: Path, run: Path, tmp_path: Path, name: str):
    assert eagletrain("data", tiny_config, "--run-dir", run).returncode == 0
    env = cli_env(EAGLETRAIN_FAULT_DELAY="extract:0.3")
    proc = eagletrain_background(
        "extract", tiny_config, "--run-dir", run, env=env, log=tmp_path / f"{name}.log"
    )
    wait_for(lambda: status_json(run)["extract"]["done"] >= 2)
    return proc


def test_stopped_worker_is_stalled_then_running_again(tiny_config: Path, tmp_path: Path):
    run = tmp_path / "run"
    proc = _start_slow_extract(tiny_config, run, tmp_path, "extract")
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(1.5)
        stopped = status_json(run, EAGLETRAIN_STALL_AFTER_S="1")["extract"]
        assert stopped["verdict"] == "stalled"
        assert stopped["note"].startswith("no heartbeat for")
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(
            lambda: (
                status_json(run, EAGLETRAIN_STALL_AFTER_S="1")["extract"]["verdict"] == "running"
            )
        )
        # what the running worker is at (a long compile says so the same way)
        shown = eagletrain("status", run).stdout
        assert "now: batch from sample " in shown.split("extract")[1].splitlines()[0], shown
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_sigint_reads_stopped_not_failed_and_a_rerun_finishes(tiny_config: Path, tmp_path: Path):
    run = tmp_path / "run"
    proc = _start_slow_extract(tiny_config, run, tmp_path, "extract")
    os.kill(proc.pid, signal.SIGINT)  # what `timeout -s INT` or Ctrl-C sends
    proc.wait(timeout=60)
    extract = status_json(run)["extract"]
    assert extract["verdict"] == "stopped", extract
    assert extract["note"] == "stopped by a signal; rerun the stage to resume"
    assert 0 < extract["done"] < extract["total"]
    assert eagletrain("extract", tiny_config, "--run-dir", run).returncode == 0
    assert status_json(run)["extract"]["verdict"] == "done"


def test_sigusr1_prints_the_stacks_and_the_stage_goes_on(tiny_config: Path, tmp_path: Path):
    run = tmp_path / "run"
    proc = _start_slow_extract(tiny_config, run, tmp_path, "stacks")
    try:
        os.kill(proc.pid, signal.SIGUSR1)
        log = tmp_path / "stacks.log"

        def dumped() -> bool:  # every thread's stack, the stage's own frames among them
            text = log.read_text()
            return "most recent call first" in text and "eagletrain/extract/" in text

        wait_for(lambda: dumped() or proc.poll() is not None)
        assert proc.poll() is None, "SIGUSR1 ended the stage"
        before = status_json(run)["extract"]["done"]
        wait_for(lambda: status_json(run)["extract"]["done"] > before)
        assert proc.poll() is None
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_second_operator_is_refused_with_the_holder(tiny_config: Path, tmp_path: Path):
    run = tmp_path / "run"
    proc = _start_slow_extract(tiny_config, run, tmp_path, "first")
    try:
        second = eagletrain("extract", tiny_config, "--run-dir", run)
        assert second.returncode == 4
        assert f"pid {proc.pid} on {socket.gethostname()} since" in second.stderr
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


def test_status_of_a_directory_that_is_not_a_run(tmp_path: Path):
    result = eagletrain("status", tmp_path)
    assert result.returncode == 2 and "not a run directory" in result.stderr
