"""Stage 3, train: the EAGLE-3 drafter on the extracted (or online) dataset, with
training-time test.

`build` makes every object once (build.py), `train_step` is one optimizer step (step.py),
`train_loop` runs epochs, held-out evaluations and checkpoints (loop.py); this module gates
the stage and records its completion.
"""

from __future__ import annotations

from typing import Any

import torch

from eagletrain.extract.metadata import read_dataset_metadata
from eagletrain.runtime.rundir import Run, require_data_target, require_previous
from eagletrain.target import pick_device, resolve_target
from eagletrain.train.build import build, check_dataset, load_datasets
from eagletrain.train.loop import STAGE, train_loop
from eagletrain.train.parallel import init_parallel


def run_train(run: Run, allow_partial: bool = False) -> dict[str, Any] | None:
    ledger, cfg = run.ledger, run.config
    parallel = init_parallel(pick_device(cfg.train.device))
    device = parallel.device(pick_device(cfg.train.device))  # this rank's own
    try:
        # ranks decide together: one that alone saw the stage complete (another job finished
        # it meanwhile) would return and leave the others waiting in a collective
        complete = torch.tensor([float(ledger.completion(STAGE) is not None)], device=device)
        if parallel.sum(complete).item() > 0:
            return None
        require_previous(run, STAGE, allow_partial)
        source = resolve_target(cfg.target)  # hashes a GGUF: once
        require_data_target(run, source.identity)
        meta = None if cfg.train.online else read_dataset_metadata(run.dir)
        if meta is not None:
            check_dataset(run, meta)
        torch.manual_seed(cfg.run.seed)
        datasets = load_datasets(run, meta, device, source)
        parts = build(run, datasets, parallel, device, source)
        if parallel.main:
            ledger.begin_stage(STAGE, "units", parts.total_steps, "steps")
            ledger.update_detail(STAGE, draft_vocab=parts.draft_vocab)
            if cfg.train.online:
                ledger.update_detail(STAGE, online_dataset=datasets.meta)
        parallel.barrier()
        best = train_loop(run, parts, parallel, device)
    finally:
        parallel.close()
    if best is None:
        return None
    evaluation = {k: v for k, v in best.items() if k != "checksum"}
    evaluation["draft_vocab"] = parts.draft_vocab
    ledger.complete(
        STAGE,
        len(datasets.train),
        sum(i.tokens or 0 for i in datasets.train_items),
        best["checksum"],
        allow_partial,
        evaluation,
    )
    return evaluation
