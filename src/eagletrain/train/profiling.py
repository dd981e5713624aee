"""Where a training step's time goes, measured on the run itself: with
`train.profile_step = N`, torch.profiler records steps N to N+2 (batch building, the online
target's forward and the step) and their kernel table is written to
train/profile-steps-N-M.txt (rank 0)."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

STEPS = 3


class StepProfiler:
    def __init__(self, directory: Path, first: int, enabled: bool):
        self.directory, self.first, self.last = directory, first, first + STEPS - 1
        self.enabled = enabled and first > 0
        self.cuda = torch.cuda.is_available()
        self._profile: profile | None = None
        self._start = 0.0

    def before(self, step: int) -> None:
        """Called before step `step` (1-based) begins."""
        if self.enabled and step == self.first:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profile = profile(activities=activities)
            self._profile.__enter__()
            self._start = time.perf_counter()

    def after(self, step: int) -> None:
        """Called once step `step` is done: the table is written after the last one."""
        if self._profile is None or step != self.last:
            return
        if self.cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - self._start) / STEPS
        self._profile.__exit__(None, None, None)
        averages = self._profile.key_averages()
        by = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = averages.table(sort_by=by, row_limit=30)
        out = self.directory / f"profile-steps-{self.first}-{self.last}.txt"
        out.write_text(f"steps {self.first}-{self.last}: {seconds:.4f} s a step (wall)\n{table}\n")
        self._profile = None
