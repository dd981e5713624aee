"""SIGKILL the pipeline at 20 seeded random moments across data, extract and train,
resuming each time: nothing lost, nothing duplicated, every per-sample checksum identical
to an uninterrupted run, and training reaching the same loss curve.

With EAGLETRAIN_RELIABILITY_REPORT=path the kill log is written there (bench/reliability.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from conftest import cli_env, eagletrain, status_json
from test_train_resume import _losses

from eagletrain.shards import read_index

KILLS = 20
TRAIN = ["--set", "train.checkpoint_every=2"]


def _done(run: Path, stage: str) -> dict[str, str]:
    conn = sqlite3.connect(run / "ledger.sqlite")
    rows = conn.execute(
        "SELECT key, checksum FROM items WHERE stage=? AND state='done'", (stage,)
    ).fetchall()
    conn.close()
    return dict(rows)


def _running_stage(run: Path) -> str | None:
    if not (run / "ledger.sqlite").exists():
        return None
    try:
        stages = status_json(run)
    except AssertionError:
        return None
    return next((s for s, v in stages.items() if v["verdict"] == "running"), None)


def _assert_no_duplicates(run: Path, stage: str, directory: str) -> None:
    keys = list(_done(run, stage))
    files = sorted(p for p in (run / directory).glob("*.safetensors"))
    indexed = [e.key for f in files for e in read_index(f)]
    assert sorted(indexed) == sorted(keys), f"{stage}: shards hold {len(indexed)} entries"


def test_twenty_random_kills_lose_and_duplicate_nothing(tiny_config: Path, tmp_path: Path):
    reference, run = tmp_path / "reference", tmp_path / "killed"
    for stage in ("data", "extract", "train"):
        assert eagletrain(stage, tiny_config, "--run-dir", reference, *TRAIN).returncode == 0

    rng = random.Random(2026)
    env = cli_env(EAGLETRAIN_FAULT_DELAY="data:0.25,extract:0.25,train:0.25")
    kills: list[str] = []
    attempts = 0
    while len(kills) < KILLS and attempts < 3 * KILLS:
        attempts += 1
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "eagletrain",
                "run",
                str(tiny_config),
                "--run-dir",
                str(run),
                *TRAIN,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        stage = None
        deadline = time.time() + 60
        while proc.poll() is None and stage is None and time.time() < deadline:
            stage = _running_stage(run)
            time.sleep(0.05)
        if proc.poll() is not None:
            break  # the pipeline finished before we could kill it again
        time.sleep(rng.uniform(0.0, 1.2))
        stage = _running_stage(run) or stage
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        if stage in ("export", "eval"):
            break
        kills.append(stage)

    final = eagletrain("run", tiny_config, "--run-dir", run, *TRAIN)
    assert final.returncode == 0, final.stderr
    counts = Counter(kills)
    if path := os.environ.get("EAGLETRAIN_RELIABILITY_REPORT"):
        Path(path).write_text(json.dumps({"kills": len(kills), "by_stage": counts}))
    assert len(kills) == KILLS and {"data", "extract", "train"} <= set(counts), counts

    stages = status_json(run)
    assert all(v["verdict"] == "done" for v in stages.values())
    assert _done(run, "data") == _done(reference, "data")  # 0 lost, identical samples
    assert _done(run, "extract") == _done(reference, "extract")
    _assert_no_duplicates(run, "data", "data")
    _assert_no_duplicates(run, "extract", "hidden")
    assert _losses(run) == _losses(reference)
