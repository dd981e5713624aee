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
from pathlib import Path
from typing import Any

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


def install() -> None:
    """Route shard writes through the simulated full disk when the environment asks for it
    (the CLI calls this at start; the write path itself knows nothing of faults)."""
    if "EAGLETRAIN_FAULT_DISK_BYTES" in os.environ:
        from eagletrain.runtime import shards

        shards.save_to_file = _save_with_disk_limit


def _save_with_disk_limit(tensors: dict[str, Any], header: dict[str, str], path: Path) -> None:
    from safetensors.torch import save

    global _written
    limit = int(os.environ["EAGLETRAIN_FAULT_DISK_BYTES"])
    blob = save(tensors, metadata=header)
    with path.open("wb") as f:
        if _written + len(blob) > limit:
            room = max(limit - _written, 0)
            f.write(blob[:room])
            _written += room
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        f.write(blob)
        _written += len(blob)
