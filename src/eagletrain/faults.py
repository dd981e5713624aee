"""Fault injection for the reliability tests, off unless set in the environment:

- EAGLETRAIN_FAULT_DELAY="extract:0.3,train:0.1": sleep per batch/step of those stages, so a
  test can watch a stage run, kill it part-way or stop it;
- EAGLETRAIN_FAULT_DISK_BYTES=N: shard writes behave as if the filesystem had N bytes free
  for this process: the write that crosses it leaves a partial file and fails with ENOSPC.
"""

from __future__ import annotations

import errno
import os
import time
from typing import BinaryIO

_written = 0


def _delays() -> dict[str, float]:
    spec = os.environ.get("EAGLETRAIN_FAULT_DELAY", "")
    out = {}
    for part in filter(None, spec.split(",")):
        stage, _, seconds = part.partition(":")
        out[stage.strip()] = float(seconds)
    return out


def inject_delay(stage: str) -> None:
    seconds = _delays().get(stage)
    if seconds:
        time.sleep(seconds)


def disk_limit_active() -> bool:
    return "EAGLETRAIN_FAULT_DISK_BYTES" in os.environ


def write_with_disk_limit(f: BinaryIO, blob: bytes, path: str) -> None:
    global _written
    limit = os.environ.get("EAGLETRAIN_FAULT_DISK_BYTES")
    if limit is not None and _written + len(blob) > int(limit):
        room = max(int(limit) - _written, 0)
        f.write(blob[:room])
        _written += room
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    f.write(blob)
    _written += len(blob)
