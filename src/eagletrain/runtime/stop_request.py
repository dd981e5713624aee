"""A stop asked for by a signal, honoured at the next step boundary.

SIGINT (Ctrl-C, `timeout -s INT`) and SIGTERM (a scheduler's preemption, torchrun passing
on its own stop to the ranks) during training do not cut a step in half: they are recorded,
and the trainer saves its exact-resume state after the step in flight, then stops. A second
signal stops at once, as SIGINT would without this.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Within `with`: `requested` turns true on SIGINT or SIGTERM (main thread only;
    elsewhere nothing is installed and the signals keep their handlers)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:  # asked twice: stop now
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
