"""A process started by torchrun dies with it.

torchrun starts each rank in a session of its own, so `kill -9` of torchrun (or of its
process group) would leave the ranks training or extracting on, writing beside whatever
the operator starts next. Linux only; elsewhere, and without torchrun, nothing changes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_launcher() -> None:
    """SIGKILL this process when its parent, the torchrun agent, dies."""
    if sys.platform == "linux" and "TORCHELASTIC_RUN_ID" in os.environ:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
