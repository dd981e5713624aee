"""Online trainer throughput on a run's own data, at the target's real shape.

    python bench/train_online.py RUN_DIR [--set KEY=VALUE ...] [--steps 30] [--warmup 5]
        [--variants padded,packed,packed+compile] [--profile packed] [--profile-out FILE]

RUN_DIR is a run whose data stage is done (a kept one: gpu/kept.txt). Each variant builds
the trainer as the train stage does (train.online, packed rows of train.pack_length) and
times `train_step` on the same batches, the batch (the target's forward inside) and the
step apart, with a device sync between them:

- padded: the target's forward over the batch's samples, each padded to the longest
  (eagletrain before ef234f6);
- packed: the target's forward over the packed rows themselves (position ids restart at
  each sample; transformers keeps attention within it);
- +compile: train.compile (the drafter's decoder layer under torch.compile).

Also times building the packed TTT block masks (flex_attention) of one batch, eager and
compiled, since the step builds one per TTT step. Prints a table, the ratio of each variant
to `padded`, then `train_tok_s=<packed slots a second of the fastest variant>` last.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from eagletrain.config import load_config
from eagletrain.drafter import _ttt_block_mask
from eagletrain.runtime.ledger import Ledger
from eagletrain.runtime.rundir import CONFIG_NAME, Run
from eagletrain.target import pick_device, resolve_target
from eagletrain.train.batches import Batch, Batcher
from eagletrain.train.build import TrainParts, build, load_datasets
from eagletrain.train.parallel import Parallel
from eagletrain.train.step import train_step


class PaddedForward:
    """The online samples without their packed forward: features from a forward over the
    samples padded to the longest, then packed (the path before packed forwards)."""

    def __init__(self, data):
        self.data, self.items = data, data.items

    def __len__(self) -> int:
        return len(self.data)

    def tokens(self, i: int) -> int:
        return self.data.tokens(i)

    def samples(self, indices: list[int]):
        return self.data.samples(indices)


def sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def time_steps(
    parts: TrainParts, batcher: Batcher, rows: int, device: torch.device, warmup: int,
    steps: int, profile_out: Path | None,
) -> dict[str, float]:  # fmt: skip
    """Mean seconds of batch building and of the step over `steps` batches of `rows` units
    after `warmup`; with `profile_out`, the kernel table of the first three timed steps."""
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    order = list(range(len(batcher)))  # an epoch's order, as the training loop shuffles it
    random.Random(0).shuffle(order)
    batch_s, step_s, loss = 0.0, 0.0, 0.0
    profiler = None
    for s in range(warmup + steps):
        if s == warmup and profile_out is not None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            profiler = torch.profiler.profile(activities=activities)
            profiler.__enter__()
        units = order[s * rows : (s + 1) * rows]
        t0 = sync(device)
        batch: Batch = batcher.batch(units).to(device, torch.float32)
        t1 = sync(device)
        figures, _ = train_step(parts.objective, parts.head, batch, parts.opt, Parallel(), autocast)
        t2 = sync(device)
        if profiler is not None and s == warmup + 2:
            profiler.__exit__(None, None, None)
            by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=by, row_limit=40)
            assert profile_out is not None
            profile_out.write_text(f"3 steps profiled (batch building and step)\n{table}\n")
            profiler = None
        if s >= warmup:
            batch_s, step_s, loss = batch_s + t1 - t0, step_s + t2 - t1, figures["loss"]
    return {"batch": batch_s / steps, "step": step_s / steps, "loss": loss}


def block_mask_seconds(segments: torch.Tensor, steps: int, compiled: bool) -> float:
    """Seconds to build one batch's packed TTT block masks (one per TTT step), as the
    drafter builds them."""
    t = segments.shape[1]

    def build_all() -> None:
        for k in range(steps):
            step = torch.full((), k, dtype=torch.long, device=segments.device)
            _ttt_block_mask(step, t, steps, segments, segments.device, compiled)

    build_all()  # compiles (compiled) or warms the allocator
    start = sync(segments.device)
    for _ in range(3):
        build_all()
    return (sync(segments.device) - start) / 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--set", dest="sets", action="append", default=[])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", default="padded,packed,packed+compile")
    parser.add_argument("--profile", default="packed", help="variant to profile ('' for none)")
    parser.add_argument("--profile-out", type=Path, default=Path("train-online-profile.txt"))
    args = parser.parse_args()
    console = Console()
    base = ["train.online=true", *args.sets]
    config = load_config(args.run_dir / CONFIG_NAME, base)
    rows = config.train.batch_size
    device = pick_device(config.train.device)
    source = resolve_target(config.target)
    torch.manual_seed(config.run.seed)
    run = Run(args.run_dir, config, Ledger(args.run_dir, create=False))
    datasets = load_datasets(run, None, device, source)
    slots = config.train.batch_size * (config.train.pack_length or 0)
    results: dict[str, dict[str, float]] = {}
    for variant in args.variants.split(","):
        sets = [*base, f"train.compile={'true' if '+compile' in variant else 'false'}"]
        vconfig = load_config(args.run_dir / CONFIG_NAME, sets)
        torch.manual_seed(config.run.seed)
        parts = build(Run(args.run_dir, vconfig, run.ledger), datasets, Parallel(), device, source)
        batcher = parts.train
        if variant.startswith("padded"):
            batcher = Batcher(PaddedForward(datasets.train), config.train.pack_length)
        out = args.profile_out if variant == args.profile else None
        results[variant] = time_steps(parts, batcher, rows, device, args.warmup, args.steps, out)
        r = results[variant]
        console.print(f"{variant}: batch {r['batch'] * 1e3:.1f} ms, step {r['step'] * 1e3:.1f} ms")
    order = list(range(len(parts.train)))
    random.Random(0).shuffle(order)
    segments = parts.train.batch(order[:rows]).segments
    assert segments is not None
    masks = {
        c: block_mask_seconds(segments.to(device), config.train.ttt_steps, c) for c in (False, True)
    }
    table = Table(
        title=f"online training, {rows} x {config.train.pack_length} packed, "
        f"TTT {config.train.ttt_steps}, {device}"
    )
    for col in ("variant", "batch ms", "step ms", "total ms", "packed tok/s", "vs padded", "loss"):
        table.add_column(col)
    baseline = results.get("padded")
    best = 0.0
    for variant, r in results.items():
        total = r["batch"] + r["step"]
        rate = slots / total
        best = max(best, rate)
        ratio = f"{(baseline['batch'] + baseline['step']) / total:.2f}x" if baseline else "-"
        table.add_row(
            variant,
            f"{r['batch'] * 1e3:.1f}",
            f"{r['step'] * 1e3:.1f}",
            f"{total * 1e3:.1f}",
            f"{rate:,.0f}",
            ratio,
            f"{r['loss']:.4f}",
        )
    console.print(table)
    console.print(
        f"block masks of one batch ({config.train.ttt_steps} TTT steps): "
        f"eager {masks[False] * 1e3:.1f} ms, compiled {masks[True] * 1e3:.1f} ms"
    )
    print(f"train_tok_s={best:.0f}")


if __name__ == "__main__":
    main()
