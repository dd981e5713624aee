"""Fault injection for the reliability tests: slow a stage down so a test can watch it run,
kill it part-way or stop it. Off unless EAGLETRAIN_FAULT_DELAY names the stage, e.g.
EAGLETRAIN_FAULT_DELAY="extract:0.3,train:0.1" (seconds per batch or step)."""

from __future__ import annotations

import os
import time


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
