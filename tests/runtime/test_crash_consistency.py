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

from conftest import cli_env, eagletrain, status_json, train_losses

from eagletrain.runtime.shards import read_index

# Where the 20 kills are aimed. The moments are seeded random; a kill whose stage has
# already finished lands in the stage then running, so the split only guarantees that every
# stage is killed and that the pipeline is still at work when the last kill comes.
PLAN = ["data"] * 3 + ["extract"] * 8 + ["train"] * 9
ORDER = ["data", "extract", "train", "export", "eval"]
# Eight epochs (about 80 steps at 0.25 s each) outlast every kill the plan can send to train.
TRAIN = ["--set", "train.checkpoint_every=2", "--set", "train.epochs=8"]


def _done(run: Path, stage: str) -> dict[str, str]:
    conn = sqlite3.connect(run / "ledger.sqlite")
    rows = conn.execute(
        "SELECT key, checksum FROM items WHERE stage=? AND state='done'", (stage,)
    ).fetchall()
    conn.close()
    return dict(rows)


def _stage_of(run: Path, pid: int) -> str | None:
    """The stage this process has registered as a running worker of, read from the ledger."""
    if not (run / "ledger.sqlite").exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{run / 'ledger.sqlite'}?mode=ro", uri=True, timeout=1)
        row = conn.execute(
            "SELECT stage FROM workers WHERE pid=? AND state='running' "
            "ORDER BY started_at DESC LIMIT 1",
            (pid,),
        ).fetchone()
        conn.close()
    except sqlite3.OperationalError:  # the schema is still being created
        return None
    return row[0] if row else None


def _kill_at_random_moment(
    run: Path, config: Path, env: dict[str, str], target: str, rng: random.Random
) -> str | None:
    """Run the pipeline until it is working on `target` (or a later stage), SIGKILL it at a
    random moment there and return that stage; None when it finished first."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagletrain", "run", str(config), "--run-dir", str(run), *TRAIN],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.time() + 120
    stage = None
    while proc.poll() is None and time.time() < deadline:
        stage = _stage_of(run, proc.pid)
        if stage is not None and ORDER.index(stage) >= ORDER.index(target):
            break
        time.sleep(0.02)
    if proc.poll() is not None:
        return None
    time.sleep(rng.uniform(0.0, 1.0))
    stage = _stage_of(run, proc.pid) or stage
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return stage


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
    kills: list[str | None] = []
    for target in PLAN:
        kills.append(_kill_at_random_moment(run, tiny_config, env, target, rng))
        if kills[-1] not in ("data", "extract", "train"):
            break

    final = eagletrain("run", tiny_config, "--run-dir", run, *TRAIN)
    assert final.returncode == 0, final.stderr
    counts = Counter(kills)
    if path := os.environ.get("EAGLETRAIN_RELIABILITY_REPORT"):
        Path(path).write_text(json.dumps({"kills": len(kills), "by_stage": counts}))
    assert len(kills) == len(PLAN) and set(counts) == {"data", "extract", "train"}, counts

    stages = status_json(run)
    assert all(v["verdict"] == "done" for v in stages.values())
    assert _done(run, "data") == _done(reference, "data")  # 0 lost, identical samples
    assert _done(run, "extract") == _done(reference, "extract")
    _assert_no_duplicates(run, "data", "data")
    _assert_no_duplicates(run, "extract", "hidden")
    assert train_losses(run) == train_losses(reference)
