"""`eagletrain status`: running / stalled / dead / done / failed / stopped / skipped, N of M,
rate, ETA.

Reads only the ledger (a handful of indexed queries) and the run's config file, never the
data directories, so it answers in milliseconds whether the run has a hundred items or a
million.
"""

from __future__ import annotations

import os
import socket
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagletrain.errors import InputError
from eagletrain.runtime.ledger import LEDGER_NAME, Ledger
from eagletrain.runtime.rundir import CONFIG_NAME
from eagletrain.runtime.worker import pid_alive
from eagletrain.stages import PROMPTS, STAGES, skipped_stages

STALL_AFTER_S = float(os.environ.get("EAGLETRAIN_STALL_AFTER_S", "30"))
NO_PROGRESS_STALL_S = float(os.environ.get("EAGLETRAIN_NO_PROGRESS_STALL_S", "900"))
# A worker on another host is only known by its heartbeat.
REMOTE_DEAD_AFTER_S = float(os.environ.get("EAGLETRAIN_REMOTE_DEAD_AFTER_S", "300"))
RATE_WINDOW_S = 300.0


@dataclass
class WorkerView:
    partition: str
    pid: int
    host: str
    verdict: str
    heartbeat_age_s: float
    progress_age_s: float
    current: str | None
    error: str | None


@dataclass
class StageStatus:
    stage: str
    verdict: str
    done: int = 0
    total: int = 0
    unit: str = "items"
    failed: int = 0
    skipped: int = 0
    rate_per_s: float | None = None
    eta_s: float | None = None
    heartbeat_age_s: float | None = None
    reasons: dict[str, int] = field(default_factory=dict)
    workers: list[WorkerView] = field(default_factory=list)
    regeneration: dict[str, Any] = field(default_factory=dict)
    prompts: dict[str, Any] = field(default_factory=dict)  # written / kept / dropped by reason
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _worker_verdict(w: dict[str, Any], now: float, host: str) -> WorkerView:
    heartbeat_age = now - w["heartbeat_at"]
    progress_age = now - (w["progress_at"] or w["started_at"])
    if w["state"] == "running":
        alive = (
            pid_alive(w["pid"], w["pid_start"])
            if w["host"] == host
            else heartbeat_age < REMOTE_DEAD_AFTER_S
        )
        if not alive:
            verdict = "dead"
        elif heartbeat_age > STALL_AFTER_S or progress_age > NO_PROGRESS_STALL_S:
            verdict = "stalled"
        else:
            verdict = "running"
    else:
        verdict = w["state"]  # exited | failed | stopped | dead
    return WorkerView(
        w["partition"],
        w["pid"],
        w["host"],
        verdict,
        heartbeat_age,
        progress_age,
        w["current"],
        w["error"],
    )


def _rate(ledger: Ledger, stage: str, now: float) -> float | None:
    window = ledger.progress_window(stage, now - RATE_WINDOW_S)
    if len(window) < 2 or window[1][0] - window[0][0] <= 0:
        return None
    (t0, d0), (t1, d1) = window
    return max(d1 - d0, 0) / (t1 - t0)


def stage_status(ledger: Ledger, stage: str, now: float | None = None) -> StageStatus:
    now = time.time() if now is None else now
    row = ledger.stage_row(stage)
    completion = ledger.completion(stage)
    if row is None:
        return StageStatus(stage, "done" if completion else "pending")
    st = StageStatus(stage, "pending", total=row["total"], unit=row["unit"])
    if row["kind"] == "items":
        counts = ledger.counts(stage)
        st.done, st.failed, st.skipped = (counts.get(k, 0) for k in ("done", "failed", "skipped"))
        if st.failed or st.skipped:
            st.reasons = ledger.error_reasons(stage)
    else:
        st.done = row["units_done"]
    if stage == PROMPTS:
        st.prompts = ledger.prompt_tally()
    if stage == "data":
        totals = ledger.regen_totals()
        part_way = ledger.partial_count()
        if totals.get("conversations") or part_way:
            st.regeneration = {
                **totals,
                "awaiting_chunk": ledger.regenerated_pending(),
                "part_way": part_way,
                "decoder": (row["detail"].get("regeneration") or {}).get("decoder"),
            }

    latest: dict[str, dict[str, Any]] = {}
    for w in ledger.workers(stage):
        latest[w["partition"]] = w
    host = socket.gethostname()
    st.workers = [_worker_verdict(w, now, host) for w in latest.values()]
    live = [w for w in st.workers if w.verdict in ("running", "stalled")]
    if live:
        st.heartbeat_age_s = min(w.heartbeat_age_s for w in live)

    if completion is not None:
        st.verdict = "done"
        if completion["allow_partial"]:
            st.note = "completed with --allow-partial"
        return st

    verdicts = {w.verdict for w in st.workers}
    for verdict in ("running", "stalled", "dead", "failed", "stopped"):
        if verdict in verdicts:
            st.verdict = verdict
            break
    else:
        st.verdict = "failed" if verdicts else "pending"
        if verdicts:
            st.note = "worker exited without a verified completion (run `eagletrain verify`)"
    if st.verdict == "stalled":
        stalled = next(w for w in st.workers if w.verdict == "stalled")
        st.note = (
            f"no heartbeat for {stalled.heartbeat_age_s:.0f}s"
            if stalled.heartbeat_age_s > STALL_AFTER_S
            else f"no progress for {stalled.progress_age_s:.0f}s"
        )
    elif st.verdict == "dead":
        dead = next(w for w in st.workers if w.verdict == "dead")
        st.note = f"worker pid {dead.pid} on {dead.host} is gone; rerun the stage to resume"
    elif st.verdict in ("failed", "stopped"):
        ended = next((w for w in st.workers if w.verdict == st.verdict), None)
        if ended is not None and ended.error:
            st.note = ended.error

    if st.verdict in ("running", "stalled"):
        st.rate_per_s = _rate(ledger, stage, now)
        remaining = st.total - st.done - st.failed - st.skipped
        remaining -= st.regeneration.get("awaiting_chunk", 0)
        if st.rate_per_s:
            st.eta_s = remaining / st.rate_per_s
    return st


def run_status(run_dir: Path) -> list[StageStatus]:
    if not (run_dir / LEDGER_NAME).is_file():
        raise InputError(f"{run_dir}: not a run directory (no {LEDGER_NAME})")
    ledger = Ledger(run_dir)
    try:
        now = time.time()
        # the prompts the target writes itself, when the run has any, come first
        names = ([PROMPTS] if ledger.stage_row(PROMPTS) else []) + list(STAGES)
        stages = [stage_status(ledger, stage, now) for stage in names]
    finally:
        ledger.close()
    skipped = _skipped(run_dir)
    for st in stages:
        if st.stage in skipped and st.verdict == "pending":
            st.verdict, st.note = "skipped", skipped[st.stage]
    return stages


def _skipped(run_dir: Path) -> dict[str, str]:
    """The stages the run's config skips, read from its TOML (no pydantic on this path)."""
    try:
        raw = tomllib.loads((run_dir / CONFIG_NAME).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    return skipped_stages(bool(raw.get("train", {}).get("online", False)))


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def format_line(st: StageStatus) -> str:
    parts = [f"{st.stage:<8}", f"{st.verdict:<8}"]
    if st.total:
        pct = 100.0 * st.done / st.total
        parts.append(f"{st.done}/{st.total} {st.unit} ({pct:.1f}%)")
    if st.failed or st.skipped:
        parts.append(f"failed {st.failed} skipped {st.skipped}")
    if st.rate_per_s is not None:
        parts.append(f"rate {st.rate_per_s:.2f}/s")
    if st.verdict in ("running", "stalled"):
        parts.append(f"eta {_duration(st.eta_s)}")
        parts.append(f"heartbeat {_duration(st.heartbeat_age_s)} ago")
        doing = [w.current for w in st.workers if w.verdict == st.verdict and w.current]
        if doing:
            parts.append(f"now: {'; '.join(doing)}")
    if st.note:
        parts.append(f"-- {st.note}")
    line = "  ".join(parts)
    if st.regeneration:
        r = st.regeneration
        line += (
            f"\n{'':10}regenerated {r['conversations']} conversations ({r['turns']} turns, "
            f"{r['truncated']} truncated), {r['prompt_tokens']} prompt + "
            f"{r['completion_tokens']} completion tokens, cost {r['cost']:.4f}"
            + (f"; {r['awaiting_chunk']} awaiting their chunk" if r["awaiting_chunk"] else "")
            + (f"; {r['part_way']} part-way" if r.get("part_way") else "")
        )
        if r.get("decoder"):
            d = r["decoder"]
            line += (
                f"\n{'':10}decoder (last run): {d['rows']} rows, {d['steps']} steps, rows busy "
                f"{d['rows_busy']:.0%}, all rows empty {d['idle_s']:.1f} s of "
                f"{d['decoding_s']:.1f} s decoding"
            )
            if "prefill_s" in d:  # recorded since 2026-12-07
                line += (
                    f"; device {d['prefill_s']:.1f} s prefilling ({d['refills']} refills, "
                    f"{d['prefill_forwards']} forwards), {d['steps_s']:.1f} s in steps"
                )
    if st.prompts:
        p = st.prompts
        dropped = ", ".join(f"{n} {why}" for why, n in sorted(p["dropped"].items()))
        line += f"\n{'':10}written {p['written']}, kept {p['kept']}; dropped: {dropped or 'none'}"
    for reason, n in sorted(st.reasons.items()):
        line += f"\n{'':10}{n} x {reason}"
    return line
