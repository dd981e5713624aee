"""The run's durable record of progress: SQLite in WAL mode, one file in the run directory.

Items are keyed by content, so re-planning the same input never double counts. Per-state
counts are kept by triggers, so reading progress costs O(1) however many items there are.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagletrain.runtime.ledger_schema import SCHEMA

LEDGER_NAME = "ledger.sqlite"


@dataclass(frozen=True)
class ItemRow:
    key: str
    ord: int
    state: str
    checksum: str | None
    tokens: int | None
    bytes: int | None
    shard: str | None
    offset: int | None
    split: str | None
    error: str | None
    attempts: int = 0


_ITEM_COLUMNS = "key, ord, state, checksum, tokens, bytes, shard, offset, split, error, attempts"


def connect(path: Path, create: bool = False) -> sqlite3.Connection:
    if not create and not path.exists():
        raise FileNotFoundError(path)
    conn = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 60000")
    if create:
        conn.execute("PRAGMA journal_mode = WAL")
    # WAL + NORMAL survives any process kill; only an OS crash can lose the last commits.
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


class Ledger:
    def __init__(self, run_dir: Path, create: bool = False):
        self.path = run_dir / LEDGER_NAME
        self.conn = connect(self.path, create=create)
        if create:
            self.conn.executescript(SCHEMA)

    def close(self) -> None:
        self.conn.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    # ---- stages -------------------------------------------------------------------------
    def begin_stage(self, stage: str, kind: str, total: int, unit: str) -> None:
        now = time.time()
        with self.transaction() as c:
            c.execute(
                "INSERT INTO stages(stage, kind, total, unit, started_at) VALUES(?,?,?,?,?) "
                "ON CONFLICT(stage) DO UPDATE SET kind=excluded.kind, total=excluded.total, "
                "unit=excluded.unit, started_at=COALESCE(stages.started_at, excluded.started_at)",
                (stage, kind, total, unit, now),
            )

    def set_units_done(self, stage: str, done: int) -> None:
        self.conn.execute("UPDATE stages SET units_done=? WHERE stage=?", (done, stage))

    def finish_stage(self, stage: str) -> None:
        self.conn.execute("UPDATE stages SET finished_at=? WHERE stage=?", (time.time(), stage))

    def stage_row(self, stage: str) -> dict[str, Any] | None:
        cur = self.conn.execute(
            "SELECT kind, total, unit, units_done, started_at, finished_at, detail "
            "FROM stages WHERE stage=?",
            (stage,),
        )
        row = cur.fetchone()
        if row is None:
            return None
        keys = ("kind", "total", "unit", "units_done", "started_at", "finished_at", "detail")
        out = dict(zip(keys, row, strict=True))
        out["detail"] = json.loads(out["detail"])
        return out

    def update_detail(self, stage: str, **values: Any) -> None:
        with self.transaction() as c:
            row = c.execute("SELECT detail FROM stages WHERE stage=?", (stage,)).fetchone()
            detail = json.loads(row[0]) if row else {}
            detail.update(values)
            c.execute("UPDATE stages SET detail=? WHERE stage=?", (json.dumps(detail), stage))

    # ---- items --------------------------------------------------------------------------
    def plan_items(self, stage: str, rows: Iterable[tuple[str, int, str | None]]) -> None:
        """Insert (key, ord, split) items as pending; items already known keep their state."""
        with self.transaction() as c:
            c.executemany(
                "INSERT INTO items(stage, key, ord, split) VALUES(?,?,?,?) "
                "ON CONFLICT(stage, key) DO NOTHING",
                ((stage, k, o, s) for k, o, s in rows),
            )

    def counts(self, stage: str) -> dict[str, int]:
        cur = self.conn.execute("SELECT state, n FROM counts WHERE stage=?", (stage,))
        return {state: n for state, n in cur if n}

    def items(
        self, stage: str, state: str | None = None, partition: tuple[int, int] = (0, 1)
    ) -> list[ItemRow]:
        index, count = partition
        sql = f"SELECT {_ITEM_COLUMNS} FROM items WHERE stage=?"
        args: list[Any] = [stage]
        if state is not None:
            sql += " AND state=?"
            args.append(state)
        if count > 1:
            sql += " AND ord % ? = ?"
            args += [count, index]
        sql += " ORDER BY ord"
        return [ItemRow(*row) for row in self.conn.execute(sql, args)]

    def begin_shard(self, stage: str, name: str, partition: str) -> None:
        self.conn.execute(
            "INSERT OR REPLACE INTO shards VALUES(?,?,?, 'writing', NULL)", (stage, name, partition)
        )

    def unfinished_shards(self, stage: str, partition: str) -> list[str]:
        cur = self.conn.execute(
            "SELECT name FROM shards WHERE stage=? AND partition_=? AND state='writing'",
            (stage, partition),
        )
        return [row[0] for row in cur]

    def forget_shards(self, stage: str, names: list[str]) -> None:
        self.conn.executemany(
            "DELETE FROM shards WHERE stage=? AND name=?", [(stage, n) for n in names]
        )

    def mark_items(
        self,
        stage: str,
        worker: str,
        results: list[dict[str, Any]],
        shard: tuple[str, int] | None = None,
    ) -> None:
        """Record finished items (and the shard holding them) in one transaction.

        Callers write and fsync the data first, then call this.
        """
        now = time.time()
        with self.transaction() as c:
            if shard is not None:
                c.execute(
                    "UPDATE shards SET state='done', bytes=? WHERE stage=? AND name=?",
                    (shard[1], stage, shard[0]),
                )
            c.executemany(
                "UPDATE items SET state=:state, attempts=attempts+1, error=:error, "
                "checksum=:checksum, tokens=:tokens, bytes=:bytes, shard=:shard, offset=:offset, "
                "worker=:worker, finished_at=:now WHERE stage=:stage AND key=:key",
                [
                    {
                        "error": None,
                        "checksum": None,
                        "tokens": None,
                        "bytes": None,
                        "shard": None,
                        "offset": None,
                        **r,
                        "stage": stage,
                        "worker": worker,
                        "now": now,
                    }
                    for r in results
                ],
            )
            c.execute("UPDATE workers SET progress_at=? WHERE id=?", (now, worker))

    def reset_items(self, stage: str, keys: list[str]) -> None:
        with self.transaction() as c:
            c.executemany(
                "UPDATE items SET state='pending', shard=NULL, offset=NULL, checksum=NULL "
                "WHERE stage=? AND key=?",
                [(stage, k) for k in keys],
            )

    def referenced_shards(self, stage: str) -> set[str]:
        cur = self.conn.execute(
            "SELECT DISTINCT shard FROM items WHERE stage=? AND shard IS NOT NULL", (stage,)
        )
        return {row[0] for row in cur}

    def error_reasons(self, stage: str) -> dict[str, int]:
        cur = self.conn.execute(
            "SELECT state || ': ' || error, COUNT(*) FROM items "
            "WHERE stage=? AND state IN ('failed', 'skipped') GROUP BY 1",
            (stage,),
        )
        return dict(cur.fetchall())

    def sample_progress(self, stage: str, done: int) -> None:
        self.conn.execute("INSERT INTO progress VALUES(?,?,?)", (stage, time.time(), done))

    def progress_window(self, stage: str, since: float) -> tuple[tuple[float, int], ...]:
        first = self.conn.execute(
            "SELECT t, done FROM progress WHERE stage=? AND t>=? ORDER BY t LIMIT 1",
            (stage, since),
        ).fetchone()
        last = self.conn.execute(
            "SELECT t, done FROM progress WHERE stage=? ORDER BY t DESC LIMIT 1", (stage,)
        ).fetchone()
        return tuple(x for x in (first, last) if x is not None)

    # ---- regenerated conversations ------------------------------------------------------
    def save_regenerated(self, key: str, row: dict[str, Any]) -> None:
        """Store one regenerated conversation (once) and add it to the running totals."""
        with self.transaction() as c:
            cur = c.execute(
                "INSERT INTO regenerated VALUES(?,?,?,?,?,?,?,?) ON CONFLICT(key) DO NOTHING",
                (
                    key,
                    json.dumps(row["messages"], ensure_ascii=False),
                    json.dumps(row["finish_reasons"]),
                    int(row["truncated"]),
                    row["prompt_tokens"],
                    row["completion_tokens"],
                    row["cost"],
                    time.time(),
                ),
            )
            c.execute("DELETE FROM regen_partial WHERE key=?", (key,))
            if cur.rowcount == 1:
                c.execute(
                    "UPDATE regen_totals SET conversations=conversations+1, turns=turns+?, "
                    "truncated=truncated+?, prompt_tokens=prompt_tokens+?, "
                    "completion_tokens=completion_tokens+?, cost=cost+? WHERE id=0",
                    (
                        len(row["finish_reasons"]),
                        int(row["truncated"]),
                        row["prompt_tokens"],
                        row["completion_tokens"],
                        row["cost"],
                    ),
                )

    def save_partial(self, key: str, row: dict[str, Any]) -> None:
        """Store the turns of a conversation regenerated so far (replacing the last save)."""
        self.conn.execute(
            "INSERT OR REPLACE INTO regen_partial VALUES(?,?,?)",
            (key, json.dumps(row, ensure_ascii=False), time.time()),
        )

    def partial(self, key: str) -> dict[str, Any] | None:
        row = self.conn.execute("SELECT row FROM regen_partial WHERE key=?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def partial_count(self) -> int:
        """Conversations with some turns regenerated and more to go."""
        try:
            return int(self.conn.execute("SELECT COUNT(*) FROM regen_partial").fetchone()[0])
        except sqlite3.OperationalError:  # a ledger from before per-turn saves
            return 0

    def regenerated(self, key: str) -> dict[str, Any] | None:
        row = self.conn.execute(
            "SELECT messages, finish_reasons, truncated FROM regenerated WHERE key=?", (key,)
        ).fetchone()
        if row is None:
            return None
        return {
            "messages": json.loads(row[0]),
            "finish_reasons": json.loads(row[1]),
            "truncated": bool(row[2]),
        }

    def regenerated_pending(self, stage: str = "data") -> int:
        """Conversations regenerated whose sample is not yet in a durable chunk."""
        try:
            row = self.conn.execute(
                "SELECT COUNT(*) FROM regenerated r JOIN items i ON i.stage=? AND i.key=r.key "
                "WHERE i.state='pending'",
                (stage,),
            ).fetchone()
        except sqlite3.OperationalError:  # a ledger from before regeneration existed
            return 0
        return int(row[0])

    def regen_totals(self) -> dict[str, Any]:
        try:
            row = self.conn.execute(
                "SELECT conversations, turns, truncated, prompt_tokens, completion_tokens, cost "
                "FROM regen_totals WHERE id=0"
            ).fetchone()
        except sqlite3.OperationalError:  # a ledger from before regeneration existed
            return {}
        keys = ("conversations", "turns", "truncated", "prompt_tokens", "completion_tokens")
        return dict(zip((*keys, "cost"), row, strict=True)) if row else {}

    # ---- prompts written by the target --------------------------------------------------
    def save_prompts(
        self,
        stage: str,
        worker: str,
        rows: list[tuple[int, int, str, int, str | None]],
        max_attempts: int,
    ) -> None:
        """(slot, attempt, text, tokens, dropped reason or None) of one batch, and their
        slots' items: done when kept, failed once a dropped slot used `max_attempts`."""
        now = time.time()
        with self.transaction() as c:
            c.executemany(
                "INSERT OR REPLACE INTO self_prompts VALUES(?,?,?,?,?,?)",
                [(*row, now) for row in rows],
            )
            gave_up = f"no usable prompt in {max_attempts} attempts"
            for slot, attempt, _text, tokens, dropped in rows:
                state = "done" if dropped is None else "pending"
                if dropped is not None and attempt + 1 >= max_attempts:
                    state = "failed"
                c.execute(
                    "UPDATE items SET state=?, attempts=?, tokens=?, worker=?, finished_at=?, "
                    "error=? WHERE stage=? AND ord=?",
                    (
                        state,
                        attempt + 1,
                        tokens if dropped is None else None,
                        worker,
                        now,
                        gave_up if state == "failed" else None,
                        stage,
                        slot,
                    ),
                )
            c.execute("UPDATE workers SET progress_at=? WHERE id=?", (now, worker))

    def kept_prompts(self) -> list[tuple[int, str]]:
        cur = self.conn.execute(
            "SELECT slot, text FROM self_prompts WHERE dropped IS NULL ORDER BY slot"
        )
        return [(int(slot), text) for slot, text in cur]

    def prompt_tally(self, mixes: dict[str, int] | None = None) -> dict[str, Any]:
        """Written, kept, and dropped by reason, with the tokens written; for each mix
        (name -> n kinds, slot s of kind s % n), the prompts kept of each kind."""
        try:
            rows = self.conn.execute(
                "SELECT dropped, COUNT(*), SUM(tokens) FROM self_prompts GROUP BY dropped"
            ).fetchall()
        except sqlite3.OperationalError:  # a ledger from before self-written prompts
            rows = []
        dropped = {reason: n for reason, n, _ in rows if reason is not None}
        kept = sum(n for reason, n, _ in rows if reason is None)
        tally = {
            "written": sum(n for _, n, _ in rows),
            "kept": kept,
            "dropped": dropped,
            "tokens": int(sum(t or 0 for _, _, t in rows)),
        }
        for name, mix in (mixes or {}).items():
            if not mix:
                continue
            per = dict(self.conn.execute(
                "SELECT slot % ?, COUNT(*) FROM self_prompts WHERE dropped IS NULL GROUP BY 1",
                (mix,),
            ).fetchall())  # fmt: skip
            tally[name] = [per.get(i, 0) for i in range(mix)]
        return tally

    # ---- completion records -------------------------------------------------------------
    def complete(
        self,
        stage: str,
        items: int,
        tokens: int,
        digest: str,
        allow_partial: bool,
        detail: dict[str, Any],
    ) -> None:
        with self.transaction() as c:
            c.execute(
                "INSERT OR REPLACE INTO completions VALUES(?,?,?,?,?,?,?)",
                (stage, time.time(), items, tokens, digest, int(allow_partial), json.dumps(detail)),
            )
            c.execute("UPDATE stages SET finished_at=? WHERE stage=?", (time.time(), stage))

    def completion(self, stage: str) -> dict[str, Any] | None:
        row = self.conn.execute(
            "SELECT verified_at, items, tokens, digest, allow_partial, detail "
            "FROM completions WHERE stage=?",
            (stage,),
        ).fetchone()
        if row is None:
            return None
        keys = ("verified_at", "items", "tokens", "digest", "allow_partial", "detail")
        out = dict(zip(keys, row, strict=True))
        out["detail"] = json.loads(out["detail"])
        return out

    def revoke_completion(self, stage: str) -> None:
        self.conn.execute("DELETE FROM completions WHERE stage=?", (stage,))

    # ---- workers ------------------------------------------------------------------------
    def workers(self, stage: str) -> list[dict[str, Any]]:
        cur = self.conn.execute(
            "SELECT id, partition_, pid, pid_start, host, started_at, heartbeat_at, "
            "progress_at, current, state, error, ended_at FROM workers WHERE stage=? "
            "ORDER BY started_at",
            (stage,),
        )
        keys = (
            "id",
            "partition",
            "pid",
            "pid_start",
            "host",
            "started_at",
            "heartbeat_at",
            "progress_at",
            "current",
            "state",
            "error",
            "ended_at",
        )
        return [dict(zip(keys, row, strict=True)) for row in cur]
