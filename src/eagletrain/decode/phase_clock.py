"""Seconds of device time per phase of queued work (a decoder's prefills and steps),
read without synchronising the device in between."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class PhaseClock:
    """On CUDA each phase is bracketed by events on the current stream, read by `settle()`
    once a later synchronisation has passed them: the time from the phase's first queued
    work to its last on the device, gaps where the device waited for the host included.
    Elsewhere work runs as it is issued, so the host's own clock is the measure."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        self.counts[phase] += 1
        if not self.cuda:
            start = time.perf_counter()
            yield
            self.seconds[phase] += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        yield
        end.record()
        self._pending.append((phase, begin, end))

    def settle(self) -> None:
        """Adds the phases queued so far (waits for their last event if it is still ahead)."""
        for phase, begin, end in self._pending:
            end.synchronize()
            self.seconds[phase] += begin.elapsed_time(end) / 1000
        self._pending.clear()
