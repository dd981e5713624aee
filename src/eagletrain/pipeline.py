"""`eagletrain run`: every stage in order, each skipped when its completion record exists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eagletrain.data.stage import run_data
from eagletrain.evaluate.stage import run_eval
from eagletrain.export import run_export
from eagletrain.extract.stage import run_extract
from eagletrain.runtime.rundir import Run
from eagletrain.train.stage import run_train


def stage_runners(
    partition: tuple[int, int], allow_partial: bool, repair: bool = False
) -> dict[str, Callable[[Run], Any]]:
    return {
        "data": lambda run: run_data(run, partition),
        "extract": lambda run: run_extract(run, partition, allow_partial, repair),
        "train": lambda run: run_train(run, allow_partial),
        "export": lambda run: run_export(run, allow_partial),
        "eval": lambda run: run_eval(run, allow_partial),
    }


def run_all(
    run: Run, allow_partial: bool = False, log: Callable[[str], None] = print
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for stage, runner in stage_runners((0, 1), allow_partial).items():
        if stage in run.config.skipped_stages:
            log(f"{stage}: skipped ({run.config.skipped_stages[stage]})")
            continue
        if run.ledger.completion(stage) is not None:
            log(f"{stage}: already verified complete, skipping")
        results[stage] = runner(run)
    return results
