"""Stage 3, train: the EAGLE-3 drafter on the extracted dataset, with training-time test.

The loop is plain PyTorch: draft vocab, drafter, AdamW with warmup + cosine decay, TTT loss
per batch, metrics per TTT step to train/metrics.jsonl and TensorBoard, progress (steps) in
the ledger, held-out evaluations (simulated acceptance length) at each epoch's end and every
`train.eval_every` steps, the best of which is the safetensors checkpoint export reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagletrain.draft_vocab import load_or_build
from eagletrain.drafter import (
    Eagle3Drafter,
    compile_decoder_layer,
    dense_ttt_attention,
    drafter_config,
)
from eagletrain.errors import ConfigError, InputError
from eagletrain.extract import (
    DataSamples,
    dataset_metadata,
    read_dataset_metadata,
    resolve_aux_ids,
)
from eagletrain.faults import inject_delay
from eagletrain.hidden_dataset import Batch, HiddenSamples
from eagletrain.ledger import ItemRow
from eagletrain.online_samples import OnlineSamples
from eagletrain.packing import pack_rows
from eagletrain.parallel import Parallel, init_parallel
from eagletrain.progress import stage_progress
from eagletrain.rundir import Run, require_data_target, require_previous
from eagletrain.sharding import (
    distribute,
    full_model_state,
    full_optimizer_state,
    grad_norm_value,
    is_sharded,
)
from eagletrain.stop_request import StopRequest
from eagletrain.target import (
    TargetSource,
    load_target,
    load_tokenizer,
    pick_device,
    resolve_target,
    template_hash,
)
from eagletrain.train_log import TrainLog
from eagletrain.train_state import Position, load_train_state, remove_older, save_train_state
from eagletrain.ttt import TargetHead, TTTObjective, TTTResult, step_denominators, step_weights
from eagletrain.worker import WorkerSession

STAGE = "train"
CHECKPOINT = "checkpoint"


def check_dataset(run: Run, meta: dict[str, Any]) -> None:
    """The data gate's second half: the dataset must be the one this config describes."""
    wanted = run.config.extract.aux_layer_ids
    if wanted is not None and list(wanted) != meta["aux_layer_ids"]:
        raise ConfigError(
            f"extract.aux_layer_ids {wanted} but the dataset was extracted with "
            f"{meta['aux_layer_ids']} ({meta['layer_id_convention']})"
        )
    data_tmpl = (run.ledger.stage_row("data") or {}).get("detail", {}).get("template_hash")
    if data_tmpl is not None and data_tmpl != meta["template_hash"]:
        raise InputError(
            f"dataset template hash {meta['template_hash']} != data stage's {data_tmpl}"
        )


def frozen_target_parts(source: TargetSource) -> tuple[Any, torch.nn.Embedding, TargetHead]:
    """The target's config, token embedding, final norm and lm_head (all frozen)."""
    target = load_target(source, "float32", torch.device("cpu"))
    config = target.config
    embed = torch.nn.Embedding.from_pretrained(target.get_input_embeddings().weight.detach())
    head = TargetHead(
        target.model.norm.weight.detach().clone(),
        config.rms_norm_eps,
        target.get_output_embeddings().weight.detach().clone(),
    )
    del target
    return config, embed, head


def lr_lambda(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def batch_ttt(
    objective: torch.nn.Module,
    drafter: Eagle3Drafter,
    head: TargetHead,
    batch: Batch,
    steps: int,
    weights: list[float],
    parallel: Parallel | None = None,
) -> TTTResult:
    """The TTT loss and metrics of one batch, target distribution from its stored states.
    Under data parallelism this rank's batch is its share of the global one: losses are
    normalised by the global mask sums and scaled by the world size, since DDP averages."""
    with torch.no_grad(), torch.autocast(batch.aux.device.type, enabled=False):
        p, in_vocab = head.distribution(batch.last, drafter.target_ids(), drafter.t2d)
    denominators = None
    if parallel is not None and parallel.active:
        denominators = parallel.sum(
            step_denominators(batch.loss_mask, in_vocab, steps, batch.segments)
        )
        weights = [w * parallel.world for w in weights]
    return objective(
        batch.aux,
        batch.input_ids,
        batch.loss_mask,
        p,
        in_vocab,
        steps,
        weights,
        denominators,
        positions=batch.positions,
        segments=batch.segments,
    )


def evaluate_heldout(
    objective: torch.nn.Module,
    drafter: Eagle3Drafter,
    head: TargetHead,
    data: HiddenSamples | OnlineSamples,
    steps: int,
    weights: list[float],
    device: torch.device,
    batch_size: int,
    pack_length: int | None = None,
) -> dict[str, Any]:
    """Held-out loss, accuracies and simulated acceptance length; in packed rows when the
    training is packed (the same figures, one sequence length for the kernels)."""
    drafter.eval()
    totals: dict[str, Any] = {"loss": 0.0, "acc": [0.0] * steps, "cond_acc": [0.0] * steps}
    accepted_sum, counted_sum, batches = 0.0, 0, 0
    rows = packed_rows(data, pack_length) if pack_length else None
    units = len(rows) if rows is not None else len(data)
    with torch.no_grad(), dense_ttt_attention(drafter):
        for s in range(0, units, batch_size):
            chunk = list(range(s, min(s + batch_size, units)))
            batch = make_batch(data, chunk, rows, pack_length).to(device, torch.float32)
            r = batch_ttt(objective, drafter, head, batch, steps, weights)
            totals["loss"] += float(r.loss)
            for k in range(steps):
                totals["acc"][k] += r.step_acc[k]
                totals["cond_acc"][k] += r.step_cond_acc[k]
            accepted_sum += float((r.accepted * r.counted).sum())
            counted_sum += int(r.counted.sum())
            batches += 1
    drafter.train()
    n = max(batches, 1)
    return {
        "heldout_loss": totals["loss"] / n,
        "heldout_acc": [a / n for a in totals["acc"]],
        "heldout_cond_acc": [a / n for a in totals["cond_acc"]],
        "simulated_acceptance_length": 1.0 + accepted_sum / max(counted_sum, 1),
        "heldout_samples": len(data),
    }


def save_checkpoint(
    directory: Path, state: dict[str, torch.Tensor], drafter: Eagle3Drafter, extra: dict[str, Any]
) -> str:
    """`state`: the drafter's whole state dict (sharding.full_model_state)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "model.safetensors.tmp"
    save_file(state, tmp)
    tmp.replace(directory / "model.safetensors")
    config = drafter.config.to_dict()
    (directory / "drafter_config.json").write_text(json.dumps(config, indent=2))
    (directory / "train_summary.json").write_text(json.dumps(extra, indent=2))
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()[:32]


def steps_in_epoch(samples: int, batch_size: int, world: int) -> int:
    """Batches per epoch; under data parallelism a last batch too small to give every rank
    a sample is left out (every rank must take part in every step)."""
    full, rest = divmod(samples, batch_size)
    return full + (1 if rest >= world else 0)


def packed_rows(data: HiddenSamples | OnlineSamples, row_tokens: int) -> list[list[int]]:
    """The samples packed into rows once (in training the same rows every epoch, their
    order shuffled per epoch)."""
    lengths = [data.tokens(i) for i in range(len(data))]
    longest = max(lengths)
    if longest > row_tokens:
        worst = data.items[lengths.index(longest)].key
        raise ConfigError(
            f"train.pack_length {row_tokens} is shorter than sample {worst} ({longest} "
            f"tokens); set it to at least data.max_length"
        )
    return pack_rows(lengths, row_tokens)


def make_batch(
    data: HiddenSamples | OnlineSamples,
    units: list[int],
    rows: list[list[int]] | None,
    pack_length: int | None,
) -> Batch:
    """The batch of these units: samples (padded), or packed rows when `rows` is given."""
    if rows is None or pack_length is None:
        return data.batch(units)
    return data.packed_batch([rows[j] for j in units], pack_length)


def run_train(run: Run, allow_partial: bool = False) -> dict[str, Any] | None:
    ledger, cfg = run.ledger, run.config
    tc = cfg.train
    parallel = init_parallel(pick_device(tc.device))
    device = parallel.device(pick_device(tc.device))  # this rank's own
    try:
        # ranks decide together: one that alone saw the stage complete (another job finished
        # it meanwhile) would return and leave the others waiting in a collective
        complete = torch.tensor([float(ledger.completion(STAGE) is not None)], device=device)
        if parallel.sum(complete).item() > 0:
            return None
        # online: the target runs in this job on the data stage's samples, no extracted dataset
        require_previous(run, STAGE, allow_partial, "data" if tc.online else None)
        source = resolve_target(cfg.target)  # hashes a GGUF: once
        require_data_target(run, source.identity)
        meta = None if tc.online else read_dataset_metadata(run.dir)
        if meta is not None:
            check_dataset(run, meta)
        torch.manual_seed(cfg.run.seed)
        return _train(run, meta, parallel, device, source, allow_partial)
    finally:
        parallel.close()


def online_dataset(
    run: Run, device: torch.device, source: TargetSource
) -> tuple[Any, dict[str, Any], list[ItemRow]]:
    """The target on the training device, its dataset metadata (as extraction would write
    it) and the data stage's samples."""
    model = load_target(source, run.config.target.dtype, device)
    aux_ids = resolve_aux_ids(run, model.config.num_hidden_layers)
    tmpl = template_hash(load_tokenizer(source))
    meta = dataset_metadata(run, model.config, source.identity, tmpl, aux_ids)
    meta["store_dtype"] = "online (not stored)"
    return model, meta, run.ledger.items("data", "done")


def _train(
    run: Run,
    meta: dict[str, Any] | None,
    parallel: Parallel,
    device: torch.device,
    source: TargetSource,
    allow_partial: bool,
) -> dict[str, Any] | None:
    ledger, cfg, tc = run.ledger, run.config, run.config.train
    if tc.batch_size % parallel.world:
        raise ConfigError(
            f"train.batch_size {tc.batch_size} (the global batch) is not divisible by the "
            f"{parallel.world} ranks"
        )
    if tc.online:
        target, meta, items = online_dataset(run, device, source)
        check_dataset(run, meta)
        data_samples = DataSamples(run)

        def dataset(rows: list[ItemRow]) -> HiddenSamples | OnlineSamples:
            return OnlineSamples(data_samples, rows, target, meta["aux_layer_ids"])

        digest = "online-" + (ledger.completion("data") or {}).get("digest", "partial")
    else:
        items = ledger.items("extract", "done")

        def dataset(rows: list[ItemRow]) -> HiddenSamples | OnlineSamples:
            return HiddenSamples(run.dir / "hidden", rows)

        digest = (ledger.completion("extract") or {}).get("digest", "partial")
    train_items = [i for i in items if i.split != "heldout"]
    heldout_items = [i for i in items if i.split == "heldout"]
    if not train_items:
        raise InputError("train: the dataset has no training samples")
    train_data, heldout = dataset(train_items), dataset(heldout_items)

    target_config, embed, head = frozen_target_parts(source)

    def masked_tokens():
        for i in range(len(train_data)):
            ids = train_data.tensor(i, "input_ids")
            yield ids[train_data.tensor(i, "loss_mask").bool()]

    def draft_vocab() -> torch.Tensor:
        return load_or_build(
            run.dir / "train",
            digest,
            tc.draft_vocab_size,
            meta["target"],
            masked_tokens,
            target_config.vocab_size,
        )

    if parallel.main:  # built once, then read from its cache by the other ranks
        draft_ids = draft_vocab()
    parallel.barrier()
    if not parallel.main:
        draft_ids = draft_vocab()
    dcfg = drafter_config(
        target_config, tc.draft_vocab_size, meta["aux_layer_ids"], tc.norm_before_residual
    )
    drafter = Eagle3Drafter(dcfg)
    drafter.set_draft_vocab(draft_ids)
    drafter.to(device)
    embed.to(device)
    # the frozen target head in the dtype its matmul runs in (bf16 on CUDA, ttt.py)
    head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = TargetHead(
        head.norm_weight.to(device), head.norm_eps, head.lm_head.to(device, head_dtype)
    )

    # a step's batch is tc.batch_size samples, or packed rows of tc.pack_length tokens
    rows = packed_rows(train_data, tc.pack_length) if tc.pack_length else None
    units = len(rows) if rows is not None else len(train_data)
    steps_per_epoch = steps_in_epoch(units, tc.batch_size, parallel.world)
    rows_per_rank = tc.batch_size // parallel.world
    total_steps = steps_per_epoch * tc.epochs
    if tc.compile:
        compile_decoder_layer(drafter)
    plain_objective = TTTObjective(drafter, embed, tc.activation_checkpointing)
    objective = distribute(plain_objective, parallel, tc.parallelism)
    # under FSDP gathering whole states and evaluating are collectives: every rank takes part
    sharded = is_sharded(drafter)
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(tc.warmup_steps, total_steps)
    )
    weights = step_weights(tc.ttt_steps, tc.step_weight_decay)
    train_dir = run.dir / "train"
    if parallel.main:
        ledger.begin_stage(STAGE, "units", total_steps, "steps")
        if tc.online:
            ledger.update_detail(STAGE, online_dataset=meta)
    parallel.barrier()
    detail = (ledger.stage_row(STAGE) or {}).get("detail", {})
    resume = detail.get("resume")
    position = Position(0, 0, 0)
    if resume and (train_dir / resume).is_dir():
        position = load_train_state(train_dir / resume, drafter, optimizer, scheduler)
    # the best held-out simulated tau so far; its checkpoint is train/checkpoint
    best = detail.get("best") if position.step else None
    if parallel.main:
        ledger.set_units_done(STAGE, position.step)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    step = position.step

    def done_steps(led) -> int:
        return (led.stage_row(STAGE) or {}).get("units_done", 0)

    def evaluate_and_keep_best(epoch: int) -> dict[str, Any]:
        """Held-out evaluation (rank 0, or every rank under FSDP); a better simulated tau
        becomes train/checkpoint."""
        nonlocal best
        figures = evaluate_heldout(
            objective if sharded else plain_objective,
            drafter,
            head,
            heldout or train_data,
            tc.ttt_steps,
            weights,
            device,
            tc.batch_size,
            tc.pack_length,
        )
        figures["heldout_split"] = "heldout" if len(heldout) else "train (no heldout)"
        figures["world_size"] = parallel.world
        log.evaluation(step, figures)
        tau = figures["simulated_acceptance_length"]
        if best is None or tau > best["simulated_acceptance_length"]:
            best = {"step": step, "epoch": epoch, **figures}
            state = full_model_state(drafter)
            if parallel.main:
                best["checksum"] = save_checkpoint(
                    train_dir / CHECKPOINT, state, drafter, {"steps": step, **figures}
                )
                ledger.update_detail(STAGE, best=best)
        return figures

    # only rank 0 reports: the ledger, metrics and the progress bar
    log = TrainLog(train_dir, position.step, enabled=parallel.main)
    with (
        WorkerSession(ledger, run.dir, STAGE, "0/1", done_counter=done_steps)
        if parallel.main
        else contextlib.nullcontext() as worker,
        stage_progress(disable=not parallel.main) as bar,
        StopRequest() as stop,
    ):
        task = bar.add_task("train", total=total_steps, completed=step, unit="steps")
        start = time.time()
        for epoch in range(position.epoch, tc.epochs):
            # each epoch's order depends only on (seed, epoch): a resumed run sees the same
            order = list(range(units))
            random.Random(cfg.run.seed * 1_000_003 + epoch).shuffle(order)
            first = position.batch if epoch == position.epoch else 0
            for b in range(first, steps_per_epoch):
                indices = order[b * tc.batch_size : (b + 1) * tc.batch_size]
                mine = indices[parallel.rank :: parallel.world]
                batch = make_batch(train_data, mine, rows, tc.pack_length)
                if rows is not None:  # an epoch's short last batch: the compiled shape
                    batch = batch.padded_to(rows_per_rank)
                batch = batch.to(device, torch.float32)
                with autocast:
                    r = batch_ttt(objective, drafter, head, batch, tc.ttt_steps, weights, parallel)
                optimizer.zero_grad(set_to_none=True)
                r.loss.backward()
                grad_norm = grad_norm_value(
                    torch.nn.utils.clip_grad_norm_(drafter.parameters(), tc.grad_clip)
                )
                optimizer.step()
                scheduler.step()
                step += 1
                # global figures: losses and accuracies are shares of the global batch
                # the last entry: ranks asked to stop (a signal), so all stop at this step
                shares = torch.tensor(
                    [
                        r.loss.item(),
                        *r.step_loss,
                        *r.step_acc,
                        int(batch.loss_mask.sum()),
                        float(stop.requested),
                    ],
                    dtype=torch.float64,
                    device=device,
                )
                shares = parallel.sum(shares).tolist()
                stopping = shares.pop() > 0
                k = tc.ttt_steps
                if parallel.active:  # per-rank losses were scaled by the world size
                    shares[0] /= parallel.world
                log.step(
                    {
                        "step": step,
                        "epoch": epoch,
                        "time": time.time() - start,
                        "loss": shares[0],
                        "lr": scheduler.get_last_lr()[0],
                        "grad_norm": grad_norm,
                        "tokens": int(shares[-1]),
                        **{f"loss_{j}": v for j, v in enumerate(shares[1 : 1 + k])},
                        **{f"acc_{j}": v for j, v in enumerate(shares[1 + k : 1 + 2 * k])},
                        # conditional accuracy is rank 0's own share (not reduced)
                        **{f"cond_acc_{j}": v for j, v in enumerate(r.step_cond_acc)},
                    }
                )
                epoch_end = b == steps_per_epoch - 1
                if epoch_end or (tc.eval_every and step % tc.eval_every == 0):
                    if parallel.main or sharded:
                        evaluate_and_keep_best(epoch)
                    parallel.barrier()
                periodic = tc.checkpoint_every and step % tc.checkpoint_every == 0
                stop_here = stopping and step < total_steps  # at the last step: just finish
                if (periodic or stop_here) and step < total_steps:
                    if parallel.main or sharded:
                        states = full_model_state(drafter), full_optimizer_state(drafter, optimizer)
                    if parallel.main:
                        log.flush()
                        name = save_train_state(
                            train_dir, Position(step, epoch, b + 1), *states, scheduler
                        )
                        ledger.update_detail(STAGE, resume=name)
                        remove_older(train_dir, name)
                if parallel.main:
                    ledger.set_units_done(STAGE, step)
                    worker.progressed()
                bar.advance(task)
                if stop_here:
                    log.close()
                    raise KeyboardInterrupt  # the CLI: "interrupted; rerun ... to resume"
                inject_delay("train")
        log.close()
        if best is None and (parallel.main or sharded):
            evaluate_and_keep_best(tc.epochs - 1)  # resumed after the last evaluation
        if not parallel.main:
            return None
        checksum = best["checksum"]
        evaluation = {k: v for k, v in best.items() if k != "checksum"}
        worker.sample_now()
    ledger.complete(
        STAGE,
        len(train_data),
        sum(i.tokens or 0 for i in train_items),
        checksum,
        allow_partial,
        evaluation,
    )
    return evaluation
