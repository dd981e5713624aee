"""Verification of a stage's output against the ledger, and its completion record.

A stage is "done" only when every planned item is accounted for and every done item's data
is where the ledger says, readable, with the recorded token count and checksum.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagletrain.errors import VerifyError
from eagletrain.runtime.ledger import ItemRow, Ledger
from eagletrain.runtime.shards import (
    SCALE_SUFFIX,
    ShardReader,
    read_index,
    sample_checksum,
    scale_names,
    shard_path,
)

# stage -> (directory inside the run, tensors whose rows make up a sample, in checksum order)
SHARDED_STAGES = {
    "data": ("data", ("input_ids", "loss_mask")),
    "extract": ("hidden", ("aux", "last", "input_ids", "loss_mask")),
}


@dataclass
class VerifyReport:
    stage: str
    checked: int = 0
    tokens: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)
    unfinished: dict[str, int] = field(default_factory=dict)
    digest: str = ""

    @property
    def ok(self) -> bool:
        return not self.bad and not self.unfinished

    def lines(self) -> list[str]:
        """The summary, then every bad sample on its own line."""
        return [self.summary(), *(f"  bad sample {k}: {why}" for k, why in self.bad)]

    def summary(self) -> str:
        if self.ok:
            return f"{self.stage}: verified {self.checked} samples, {self.tokens} tokens"
        parts = []
        if self.unfinished:
            parts.append(
                "unfinished: " + ", ".join(f"{n} {s}" for s, n in sorted(self.unfinished.items()))
            )
        if self.bad:
            names = ", ".join(f"{k} ({why})" for k, why in self.bad[:20])
            more = f" and {len(self.bad) - 20} more" if len(self.bad) > 20 else ""
            parts.append(f"{len(self.bad)} bad samples: {names}{more}")
        return f"{self.stage}: " + "; ".join(parts)


def _shard_bytes(ledger: Ledger, stage: str) -> dict[str, int]:
    cur = ledger.conn.execute(
        "SELECT name, bytes FROM shards WHERE stage=? AND state='done'", (stage,)
    )
    return dict(cur.fetchall())


def _check_shard(
    path: Path,
    expected_bytes: int | None,
    items: list[ItemRow],
    names: tuple[str, ...],
    deep: bool,
) -> list[tuple[str, str]]:
    if not path.is_file():
        return [(i.key, f"shard {path.name} missing") for i in items]
    size = path.stat().st_size
    if expected_bytes is not None and size != expected_bytes:
        return [
            (i.key, f"shard {path.name} is {size} bytes, expected {expected_bytes}") for i in items
        ]
    try:
        index = {e.key: e for e in read_index(path)}
        reader = ShardReader(path)
    except Exception as err:  # any parse failure means every sample in it is lost
        return [(i.key, f"shard {path.name} unreadable: {type(err).__name__}") for i in items]
    # float8 shards also hold per-token scales, part of each sample's checksum
    present = set(reader.keys())
    names = (*names, *scale_names(n for n in names if f"{n}{SCALE_SUFFIX}" in present))
    bad = []
    for item in items:
        entry = index.get(item.key)
        if entry is None:
            bad.append((item.key, f"not in {path.name} index"))
        elif (entry.offset, entry.tokens, entry.checksum) != (
            item.offset,
            item.tokens,
            item.checksum,
        ):
            bad.append((item.key, f"{path.name} index disagrees with the ledger"))
        elif deep:
            try:
                rows = [reader.rows(n, entry.offset, entry.tokens) for n in names]
            except Exception as err:
                bad.append((item.key, f"rows unreadable: {type(err).__name__}"))
                continue
            if any(r.shape[0] != entry.tokens for r in rows):
                bad.append((item.key, "row count != token count"))
            elif sample_checksum(rows) != entry.checksum:
                bad.append((item.key, "checksum mismatch"))
    return bad


def verify_stage(run_dir: Path, ledger: Ledger, stage: str, deep: bool = True) -> VerifyReport:
    report = VerifyReport(stage)
    counts = ledger.counts(stage)
    for state in ("pending", "failed"):
        if counts.get(state):
            report.unfinished[state] = counts[state]
    if stage not in SHARDED_STAGES:
        return report
    directory, names = SHARDED_STAGES[stage]
    done = ledger.items(stage, "done")
    by_shard: dict[str, list[ItemRow]] = defaultdict(list)
    for item in done:
        by_shard[item.shard or "?"].append(item)
    sizes = _shard_bytes(ledger, stage)
    for shard, items in sorted(by_shard.items()):
        try:
            path = shard_path(run_dir / directory, shard)
        except ValueError as err:
            report.bad += [(i.key, str(err)) for i in items]
            continue
        report.bad += _check_shard(path, sizes.get(shard), items, names, deep)
    if stage == "extract":
        data_tokens = {i.key: i.tokens for i in ledger.items("data", "done")}
        report.bad += [
            (i.key, f"{i.tokens} hidden rows but {data_tokens.get(i.key)} tokens")
            for i in done
            if data_tokens.get(i.key) != i.tokens
        ]
    report.checked = len(done)
    report.tokens = sum(i.tokens or 0 for i in done)
    digest = hashlib.sha256()
    for item in sorted(done, key=lambda i: i.key):
        digest.update(f"{item.key}:{item.checksum}\n".encode())
    report.digest = digest.hexdigest()[:32]
    return report


def finalize_items_stage(
    run_dir: Path,
    ledger: Ledger,
    stage: str,
    detail: dict[str, Any] | None = None,
    deep: bool = True,
) -> VerifyReport:
    """Verify and, when everything checks, write the completion record the next stage needs."""
    counts = ledger.counts(stage)
    if counts.get("pending") and not counts.get("failed"):
        return VerifyReport(stage, unfinished={"pending": counts["pending"]})  # others work on
    report = verify_stage(run_dir, ledger, stage, deep=deep)
    if report.unfinished.get("failed"):
        failed = ledger.items(stage, "failed")
        names = ", ".join(f"{i.key} ({i.error})" for i in failed[:10])
        raise VerifyError(f"{stage}: {len(failed)} samples failed: {names}")
    if report.unfinished:
        return report
    if report.bad:
        ledger.revoke_completion(stage)
        raise VerifyError(report.summary())
    counts = ledger.counts(stage)
    full_detail = {"skipped": counts.get("skipped", 0), **(detail or {})}
    ledger.complete(stage, report.checked, report.tokens, report.digest, False, full_detail)
    return report
