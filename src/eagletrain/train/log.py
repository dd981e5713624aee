"""Training metrics, written by rank 0 only: one JSON line per step and per held-out
evaluation in train/metrics.jsonl, the same scalars as TensorBoard events in
train/tensorboard, and each evaluation's per-row replayed chain (tokens, cycles) in
train/heldout_rows.jsonl (runs evaluated on the same rows compare pairwise). On resume,
lines and events after the resumed step are dropped, so a replayed step never appears
twice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagletrain.train.state import truncate_metrics

HELDOUT_ROWS = "heldout_rows.jsonl"


class TrainLog:
    def __init__(self, train_dir: Path, resumed_step: int, enabled: bool = True):
        self.enabled = enabled
        self.path = train_dir / "metrics.jsonl"
        self.rows_path = train_dir / HELDOUT_ROWS
        if not enabled:
            return
        truncate_metrics(self.path, resumed_step)
        truncate_metrics(self.rows_path, resumed_step)
        self.file = self.path.open("a")
        self.rows_file = self.rows_path.open("a")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # a declared dependency, but an image may lack it
            print("train: no TensorBoard events (the tensorboard package is not installed)")
            self.board = _NoBoard()
            return
        # purge_step: TensorBoard discards earlier events at steps >= the resumed one
        self.board = SummaryWriter(str(train_dir / "tensorboard"), purge_step=resumed_step + 1)

    def step(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key not in ("step", "epoch") and isinstance(value, int | float):
                self.board.add_scalar(f"train/{key}", value, record["step"])

    def evaluation(self, step: int, figures: dict[str, Any], rows: list[tuple[int, int]]) -> None:
        """`rows`: each held-out row's replayed chain (tokens, cycles)."""
        if not self.enabled:
            return
        self.rows_file.write(json.dumps({"step": step, "rows": rows}) + "\n")
        self.file.write(json.dumps({"step": step, "eval": figures}) + "\n")
        self.board.add_scalar(
            "heldout/simulated_acceptance_length", figures["simulated_acceptance_length"], step
        )
        self.board.add_scalar("heldout/chain_tau", figures["chain_tau"], step)
        self.board.add_scalar("heldout/loss", figures["heldout_loss"], step)
        for k, acc in enumerate(figures["heldout_acc"]):
            self.board.add_scalar(f"heldout/acc_{k}", acc, step)
        self.flush()

    def flush(self) -> None:
        if self.enabled:
            self.file.flush()
            self.rows_file.flush()
            self.board.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            self.rows_file.close()
            self.board.close()


class _NoBoard:
    def add_scalar(self, *args: object) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
