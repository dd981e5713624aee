"""SIGKILL during extraction, as an operator would see it: status reports running with a
rate and ETA, then dead with the exact count; train refuses naming the shortfall; a rerun
finishes without re-extracting finished samples and without duplicates."""

from __future__ import annotations

import os
import signal
import sqlite3
from pathlib import Path

from conftest import cli_env, eagletrain, eagletrain_background, status_json, wait_for

from eagletrain.runtime.shards import read_index


def _extract_rows(run: Path) -> dict[str, str]:
    conn = sqlite3.connect(run / "ledger.sqlite")
    rows = dict(
        conn.execute(
            "SELECT key, shard FROM items WHERE stage='extract' AND state='done'"
        ).fetchall()
    )
    conn.close()
    return rows


def test_sigkill_during_extract_then_resume(tiny_config: Path, tmp_path: Path):
    run = tmp_path / "run"
    env = cli_env(EAGLETRAIN_FAULT_DELAY="extract:0.4")
    proc = eagletrain_background(
        "run", tiny_config, "--run-dir", run, env=env, log=tmp_path / "run.log"
    )
    try:

        def extracting():
            if not (run / "ledger.sqlite").exists():
                return None
            st = status_json(run)["extract"]
            return st if st["done"] >= 8 and st["eta_s"] is not None else None

        seen = wait_for(extracting)
        assert seen["verdict"] == "running"
        assert 0 < seen["done"] < seen["total"]
        assert seen["rate_per_s"] > 0
        remaining = seen["total"] - seen["done"]
        assert abs(seen["eta_s"] - remaining / seen["rate_per_s"]) < 1e-6
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()

    before_resume = _extract_rows(run)
    dead = status_json(run)["extract"]
    assert dead["verdict"] == "dead"
    assert dead["done"] == len(before_resume)
    assert f"pid {proc.pid}" in dead["note"]

    refused = eagletrain("train", tiny_config, "--run-dir", run)
    assert refused.returncode == 3
    assert f"{len(before_resume)} of {dead['total']} samples present" in refused.stderr

    resumed = eagletrain("run", tiny_config, "--run-dir", run)
    assert resumed.returncode == 0, resumed.stderr
    after = _extract_rows(run)
    assert len(after) == dead["total"]
    # finished samples were not extracted again: same shard as before the kill
    assert all(after[key] == shard for key, shard in before_resume.items())
    # no sample appears twice across the shards, and every shard is one the ledger knows
    indexed = [e.key for shard in set(after.values()) for e in read_index(run / "hidden" / shard)]
    assert sorted(indexed) == sorted(after)
    assert status_json(run)["extract"]["verdict"] == "done"


def _data_checksums(run: Path) -> dict[str, str]:
    conn = sqlite3.connect(run / "ledger.sqlite")
    rows = dict(conn.execute("SELECT key, checksum FROM items WHERE stage='data' AND state='done'"))
    conn.close()
    return rows


def test_run_dir_moved_mid_stage_resumes_where_it_lands(tiny_config: Path, tmp_path: Path):
    """A run directory is self-contained: killed part-way through the data stage and moved
    (as when it is carried to another machine), it resumes at its new path with the same
    samples as an uninterrupted run."""
    reference = tmp_path / "reference"
    assert eagletrain("data", tiny_config, "--run-dir", reference).returncode == 0

    first = tmp_path / "machine-a" / "run"
    env = cli_env(EAGLETRAIN_FAULT_DELAY="data:0.5")
    proc = eagletrain_background(
        "data", tiny_config, "--run-dir", first, env=env, log=tmp_path / "a.log"
    )
    try:
        wait_for(lambda: (first / "ledger.sqlite").exists() and status_json(first)["data"]["done"])
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    before = _data_checksums(first)
    assert 0 < len(before) < len(_data_checksums(reference))

    moved = tmp_path / "machine-b" / "elsewhere"
    moved.parent.mkdir()
    first.rename(moved)
    assert status_json(moved)["data"]["verdict"] == "dead"
    resumed = eagletrain("data", tiny_config, "--run-dir", moved)
    assert resumed.returncode == 0, resumed.stderr
    after = _data_checksums(moved)
    assert after == _data_checksums(reference)
    assert all(after[key] == checksum for key, checksum in before.items())
    assert eagletrain("verify", moved).returncode == 0
