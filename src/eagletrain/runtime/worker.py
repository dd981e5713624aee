"""A stage worker's presence in the ledger: exclusive claim, heartbeat, clean or failed exit.

The claim is an OS file lock (released by the kernel when the process dies, however it dies)
plus a worker row that tells others who holds it. A heartbeat thread keeps the row fresh and
samples progress, so `status` can tell running from stalled from dead without any log.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from eagletrain.errors import LockHeldError
from eagletrain.runtime.ledger import Ledger, connect

HEARTBEAT_S = float(os.environ.get("EAGLETRAIN_HEARTBEAT_S", "2"))


def process_start_time(pid: int) -> str | None:
    """Kernel start time of a pid (guards against pid reuse); None if gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def pid_alive(pid: int, pid_start: str | None) -> bool:
    start = process_start_time(pid)
    return start is not None and (pid_start is None or start == pid_start)


class WorkerSession:
    """Context manager: claim (stage, partition), heartbeat while inside, record the outcome."""

    def __init__(
        self,
        ledger: Ledger,
        run_dir: Path,
        stage: str,
        partition: str = "0/1",
        done_counter: Callable[[Ledger], int] | None = None,
    ):
        self.ledger = ledger
        self.stage = stage
        self.partition = partition
        self.id = f"{stage}-{partition.replace('/', 'of')}-{uuid.uuid4().hex[:8]}"
        self.lock_path = run_dir / "locks" / f"{stage}.{partition.replace('/', 'of')}.lock"
        self._done_counter = done_counter
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock_fd: int | None = None

    def _claim(self) -> None:
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = next(
                (
                    w
                    for w in reversed(self.ledger.workers(self.stage))
                    if w["partition"] == self.partition and w["state"] == "running"
                ),
                None,
            )
            who = (
                f"pid {holder['pid']} on {holder['host']} since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(holder['started_at']))}"
                if holder
                else "another process"
            )
            raise LockHeldError(
                f"stage {self.stage} partition {self.partition} is already being worked by {who}"
            ) from None
        self._lock_fd = fd

    def __enter__(self) -> WorkerSession:
        self._claim()
        now = time.time()
        pid = os.getpid()
        with self.ledger.transaction() as c:
            # Rows left 'running' by a killed predecessor of this partition are now known dead.
            c.execute(
                "UPDATE workers SET state='dead', ended_at=heartbeat_at "
                "WHERE stage=? AND partition_=? AND state='running'",
                (self.stage, self.partition),
            )
            c.execute(
                "INSERT INTO workers(id, stage, partition_, pid, pid_start, host, started_at, "
                "heartbeat_at, state) VALUES(?,?,?,?,?,?,?,?, 'running')",
                (
                    self.id,
                    self.stage,
                    self.partition,
                    pid,
                    process_start_time(pid),
                    socket.gethostname(),
                    now,
                    now,
                ),
            )
        self._thread = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        self._thread.start()
        return self

    def _heartbeat(self) -> None:
        conn = connect(self.ledger.path)
        side = Ledger.__new__(Ledger)
        side.path, side.conn = self.ledger.path, conn
        while not self._stop.wait(HEARTBEAT_S):
            self._beat(side)
        conn.close()

    def _beat(self, ledger: Ledger) -> None:
        ledger.conn.execute("UPDATE workers SET heartbeat_at=? WHERE id=?", (time.time(), self.id))
        if self._done_counter is not None:
            ledger.sample_progress(self.stage, self._done_counter(ledger))

    def sample_now(self) -> None:
        self._beat(self.ledger)

    def progressed(self) -> None:
        """Note progress on a stage counted in units (steps, prompts) rather than items."""
        self.ledger.conn.execute(
            "UPDATE workers SET progress_at=? WHERE id=?", (time.time(), self.id)
        )

    def set_current(self, what: str) -> None:
        self.ledger.conn.execute("UPDATE workers SET current=? WHERE id=?", (what, self.id))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if exc_type is None:
            state, error = "exited", None
        elif issubclass(exc_type, KeyboardInterrupt):  # SIGINT, or SIGTERM in training
            state, error = "stopped", "stopped by a signal; rerun the stage to resume"
        else:
            state, error = "failed", f"{type(exc).__name__}: {exc}"[:500]
        self.sample_now()
        self.ledger.conn.execute(
            "UPDATE workers SET state=?, error=?, ended_at=?, heartbeat_at=? WHERE id=?",
            (state, error, time.time(), time.time(), self.id),
        )
        if self._lock_fd is not None:
            os.close(self._lock_fd)
