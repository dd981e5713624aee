"""Everything a training run needs, built once from the run's config: the datasets and
their batchers, the draft vocabulary, the drafter and its TTT objective (spread over the
ranks), the frozen target head, the optimizer and its schedule."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from eagletrain.data.samples import DataSamples
from eagletrain.data.token_coverage import coverage, coverage_curve
from eagletrain.drafter import (
    Eagle3Drafter,
    compile_decoder_layer,
    drafter_config,
    set_ttt_attention,
)
from eagletrain.errors import ConfigError, InputError
from eagletrain.extract.metadata import dataset_metadata, resolve_aux_ids
from eagletrain.runtime.ledger import ItemRow
from eagletrain.runtime.rundir import Run
from eagletrain.target import (
    TargetSource,
    load_target,
    load_tokenizer,
    template_hash,
)
from eagletrain.train.batches import Batcher
from eagletrain.train.draft_vocab import (
    build_draft_vocab,
    cached_counts,
    resolve_size,
)
from eagletrain.train.hidden_samples import HiddenSamples
from eagletrain.train.online_samples import OnlineSamples
from eagletrain.train.parallel import Parallel
from eagletrain.train.sharding import distribute, is_sharded
from eagletrain.train.step import Optimization
from eagletrain.train.ttt import TargetHead, TTTObjective, TTTSettings, step_weights


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


def steps_in_epoch(units: int, batch_size: int, world: int) -> int:
    """Batches per epoch; under data parallelism a last batch too small to give every rank
    a unit is left out (every rank must take part in every step)."""
    full, rest = divmod(units, batch_size)
    return full + (1 if rest >= world else 0)


@dataclass
class Datasets:
    """The training and held-out samples (extracted, or computed online), the dataset's
    metadata and the digest that names its draft vocabulary."""

    train: HiddenSamples | OnlineSamples
    heldout: HiddenSamples | OnlineSamples
    meta: dict[str, Any]
    digest: str
    train_items: list[ItemRow]


def load_datasets(
    run: Run, meta: dict[str, Any] | None, device: torch.device, source: TargetSource
) -> Datasets:
    ledger = run.ledger
    if run.config.train.online:
        # the target on the training device; its metadata as extraction would write it
        target = load_target(source, run.config.target.dtype, device)
        aux_ids = resolve_aux_ids(run, target.config.num_hidden_layers)
        tmpl = template_hash(load_tokenizer(source))
        meta = dataset_metadata(run, target.config, source.identity, tmpl, aux_ids)
        meta["store_dtype"] = "online (not stored)"
        check_dataset(run, meta)
        items, data_samples = ledger.items("data", "done"), DataSamples(run)

        def dataset(rows: list[ItemRow]) -> HiddenSamples | OnlineSamples:
            return OnlineSamples(data_samples, rows, target, aux_ids)

        digest = "online-" + (ledger.completion("data") or {}).get("digest", "partial")
    else:
        assert meta is not None
        items = ledger.items("extract", "done")

        def dataset(rows: list[ItemRow]) -> HiddenSamples | OnlineSamples:
            return HiddenSamples(run.dir / "hidden", rows)

        digest = (ledger.completion("extract") or {}).get("digest", "partial")
    train_items = [i for i in items if i.split != "heldout"]
    heldout_items = [i for i in items if i.split == "heldout"]
    if not train_items:
        raise InputError("train: the dataset has no training samples")
    return Datasets(dataset(train_items), dataset(heldout_items), meta, digest, train_items)


@dataclass
class TrainParts:
    """A training run's objects, built once (`build`)."""

    drafter: Eagle3Drafter
    objective: torch.nn.Module  # what the step calls: the objective, DDP- or FSDP-wrapped
    plain_objective: TTTObjective  # unwrapped: rank 0's held-out evaluation under DDP
    head: TargetHead
    opt: Optimization
    train: Batcher
    heldout: Batcher  # the training batcher when there is no held-out split
    steps_per_epoch: int
    total_steps: int
    sharded: bool  # FSDP: gathering states and evaluating are collectives
    meta: dict[str, Any]
    draft_vocab: dict[str, Any]  # its size, the training data's coverage, the curve


def _masked_tokens(data: HiddenSamples | OnlineSamples) -> Iterator[torch.Tensor]:
    for i in range(len(data)):
        ids = data.tensor(i, "input_ids")
        yield ids[data.tensor(i, "loss_mask").bool()]


def build(
    run: Run,
    datasets: Datasets,
    parallel: Parallel,
    device: torch.device,
    source: TargetSource,
) -> TrainParts:
    tc = run.config.train
    if tc.batch_size % parallel.world:
        raise ConfigError(
            f"train.batch_size {tc.batch_size} (the global batch) is not divisible by the "
            f"{parallel.world} ranks"
        )
    target_config, embed, head = frozen_target_parts(source)
    train_data, meta = datasets.train, datasets.meta

    def counts() -> torch.Tensor:
        return cached_counts(
            run.dir / "train",
            datasets.digest,
            meta["target"],
            lambda: _masked_tokens(train_data),
            target_config.vocab_size,
        )

    if parallel.main:  # counted once, then read from the cache by the other ranks
        token_counts = counts()
    parallel.barrier()
    if not parallel.main:
        token_counts = counts()
    size = resolve_size(token_counts, tc.draft_vocab_size, tc.draft_vocab_coverage)
    draft_ids = build_draft_vocab(token_counts, size)
    draft_vocab = {
        "draft_vocab_size": size,
        "train_coverage": coverage(token_counts, size),
        **coverage_curve(token_counts),
    }
    dcfg = drafter_config(
        target_config,
        size,
        meta["aux_layer_ids"],
        tc.norm_before_residual,
        tc.draft_intermediate_size,
    )
    drafter = Eagle3Drafter(dcfg)
    drafter.set_draft_vocab(draft_ids)
    set_ttt_attention(drafter, tc.ttt_attention)
    drafter.to(device)
    embed.to(device)
    # the frozen target head in the dtype its matmul runs in (bf16 on CUDA, ttt.py)
    head_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    head = TargetHead(
        head.norm_weight.to(device),
        head.norm_eps,
        head.lm_head.to(device, head_dtype),
        tc.target_temperature,
    )
    # a step's batch is tc.batch_size samples, or packed rows of tc.pack_length tokens
    train = Batcher(train_data, tc.pack_length)
    heldout = Batcher(datasets.heldout, tc.pack_length) if len(datasets.heldout) else train
    steps_per_epoch = steps_in_epoch(len(train), tc.batch_size, parallel.world)
    total_steps = steps_per_epoch * tc.epochs
    if tc.compile:
        compile_decoder_layer(drafter)
    compile_head = tc.compile_head == "on" or (tc.compile_head == "auto" and device.type == "cuda")
    settings = TTTSettings(
        tc.ttt_steps,
        step_weights(tc.ttt_steps, tc.step_weight_decay),
        tc.activation_checkpointing,
        compile_head,
    )
    plain_objective = TTTObjective(drafter, embed, settings)
    objective = distribute(plain_objective, parallel, tc.parallelism)
    optimizer = torch.optim.AdamW(
        drafter.parameters(), lr=tc.lr, betas=(0.9, 0.95), weight_decay=0.0
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(tc.warmup_steps, total_steps)
    )
    return TrainParts(
        drafter,
        objective,
        plain_objective,
        head,
        Optimization(optimizer, scheduler, tc.grad_clip),
        train,
        heldout,
        steps_per_epoch,
        total_steps,
        is_sharded(drafter),
        meta,
        draft_vocab,
    )
