"""The training loop: epochs in a (seed, epoch)-determined order, one `train_step` per
batch, held-out evaluations that keep the best checkpoint, exact-resume checkpoints, and
progress in the ledger. Only rank 0 reports (ledger, metrics, progress bar)."""

from __future__ import annotations

import contextlib
import random
import time
from typing import Any

import torch

from eagletrain.runtime.faults import inject_delay
from eagletrain.runtime.progress import stage_progress
from eagletrain.runtime.rundir import Run
from eagletrain.runtime.stop_request import StopRequest
from eagletrain.runtime.worker import WorkerSession
from eagletrain.train.build import TrainParts
from eagletrain.train.checkpoint import CHECKPOINT, save_checkpoint
from eagletrain.train.heldout import evaluate_heldout
from eagletrain.train.log import TrainLog
from eagletrain.train.parallel import Parallel
from eagletrain.train.profiling import StepProfiler
from eagletrain.train.sharding import full_model_state, full_optimizer_state
from eagletrain.train.state import Position, load_train_state, remove_older, save_train_state
from eagletrain.train.step import train_step

STAGE = "train"


class BestCheckpoint:
    """Held-out evaluations; a better simulated tau than any before becomes train/checkpoint
    (rank 0 writes; under FSDP every rank takes part in gathering the state)."""

    def __init__(self, run: Run, parts: TrainParts, parallel: Parallel, device: torch.device):
        self.run, self.parts, self.parallel, self.device = run, parts, parallel, device
        detail = (run.ledger.stage_row(STAGE) or {}).get("detail", {})
        self.best: dict[str, Any] | None = detail.get("best")

    def evaluate(self, step: int, epoch: int, log: TrainLog) -> None:
        parts, parallel = self.parts, self.parallel
        objective = parts.objective if parts.sharded else parts.plain_objective
        config = self.run.config
        figures = evaluate_heldout(
            objective,
            parts.head,
            parts.heldout,
            config.train.batch_size,
            self.device,
            chain_steps=config.eval.draft_steps,
        )
        figures["heldout_split"] = (
            "heldout" if parts.heldout is not parts.train else ("train (no heldout)")
        )
        figures["world_size"] = parallel.world
        rows = figures.pop("chain_per_row")
        log.evaluation(step, figures, rows)
        tau = figures["simulated_acceptance_length"]
        if self.best is not None and tau <= self.best["simulated_acceptance_length"]:
            return
        self.best = {"step": step, "epoch": epoch, **figures}
        state = full_model_state(parts.drafter)
        if parallel.main:
            directory = self.run.dir / "train" / CHECKPOINT
            extra = {"steps": step, **figures}
            self.best["checksum"] = save_checkpoint(directory, state, parts.drafter, extra)
            self.run.ledger.update_detail(STAGE, best=self.best)


def train_loop(
    run: Run, parts: TrainParts, parallel: Parallel, device: torch.device
) -> dict[str, Any] | None:
    """Trains from the ledger's resume point to the end; returns the best evaluation (rank
    0; None elsewhere). A stop request (a signal on any rank) saves the step in flight and
    raises KeyboardInterrupt on every rank at the same step."""
    ledger, tc = run.ledger, run.config.train
    train_dir = run.dir / "train"
    detail = (ledger.stage_row(STAGE) or {}).get("detail", {})
    position = Position(0, 0, 0)
    if detail.get("resume") and (train_dir / detail["resume"]).is_dir():
        opt = parts.opt
        position = load_train_state(
            train_dir / detail["resume"], parts.drafter, opt.optimizer, opt.scheduler
        )
    best = BestCheckpoint(run, parts, parallel, device)
    if not position.step:
        best.best = None
    if parallel.main:
        ledger.set_units_done(STAGE, position.step)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    rows_per_rank = tc.batch_size // parallel.world
    step, total = position.step, parts.total_steps

    def done_steps(led) -> int:
        return (led.stage_row(STAGE) or {}).get("units_done", 0)

    log = TrainLog(train_dir, position.step, enabled=parallel.main)
    profiler = StepProfiler(train_dir, tc.profile_step, enabled=parallel.main)
    with (
        WorkerSession(ledger, run.dir, STAGE, "0/1", done_counter=done_steps)
        if parallel.main
        else contextlib.nullcontext() as worker,
        stage_progress(disable=not parallel.main) as bar,
        StopRequest() as stop,
    ):
        task = bar.add_task("train", total=total, completed=step, unit="steps")
        start = time.time()
        for epoch in range(position.epoch, tc.epochs):
            # each epoch's order depends only on (seed, epoch): a resumed run sees the same
            order = list(range(len(parts.train)))
            random.Random(run.config.run.seed * 1_000_003 + epoch).shuffle(order)
            first = position.batch if epoch == position.epoch else 0
            for b in range(first, parts.steps_per_epoch):
                profiler.before(step + 1)
                units = order[b * tc.batch_size : (b + 1) * tc.batch_size]
                batch = parts.train.batch(units[parallel.rank :: parallel.world])
                if parts.train.rows is not None:  # an epoch's short last batch: the same shape
                    batch = batch.padded_to(rows_per_rank)
                batch = batch.to(device, torch.float32)
                figures, stopping = train_step(
                    parts.objective, parts.head, batch, parts.opt, parallel, autocast,
                    stop.requested,
                )  # fmt: skip
                step += 1
                profiler.after(step)
                log.step({"step": step, "epoch": epoch, "time": time.time() - start, **figures})
                if b == parts.steps_per_epoch - 1 or (tc.eval_every and step % tc.eval_every == 0):
                    if parallel.main or parts.sharded:
                        best.evaluate(step, epoch, log)
                    parallel.barrier()
                stop_here = stopping and step < total  # at the last step: just finish
                periodic = tc.checkpoint_every and step % tc.checkpoint_every == 0
                if (periodic or stop_here) and step < total:
                    _save_resume_state(run, parts, parallel, log, Position(step, epoch, b + 1))
                if parallel.main:
                    ledger.set_units_done(STAGE, step)
                    worker.progressed()
                bar.advance(task)
                if stop_here:
                    log.close()
                    raise KeyboardInterrupt  # the CLI: "interrupted; rerun ... to resume"
                inject_delay("train")
        log.close()
        if best.best is None and (parallel.main or parts.sharded):
            best.evaluate(step, tc.epochs - 1, log)  # resumed after the last evaluation
        if parallel.main:
            worker.sample_now()
    return best.best if parallel.main else None


def _save_resume_state(
    run: Run, parts: TrainParts, parallel: Parallel, log: TrainLog, position: Position
) -> None:
    """An exact-resume checkpoint at `position` (gathered on every rank under FSDP)."""
    if not (parallel.main or parts.sharded):
        return
    states = (
        full_model_state(parts.drafter),
        full_optimizer_state(parts.drafter, parts.opt.optimizer),
    )
    if parallel.main:
        log.flush()
        train_dir = run.dir / "train"
        config = parts.drafter.config.to_dict()
        name = save_train_state(train_dir, position, *states, parts.opt.scheduler, config)
        run.ledger.update_detail(STAGE, resume=name)
        remove_older(train_dir, name)
