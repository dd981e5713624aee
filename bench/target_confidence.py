"""How sure is the target of its own replies? Over the reply positions of a run's held-out
conversations (the data stage's tokens: replies the target wrote itself), the target's
probability of its top token and its entropy: the spread that soft training targets ask
the drafter to model, where greedy acceptance needs only the argmax
(`train.target_temperature`).

    .venv/bin/python bench/target_confidence.py RUN_DIR [--conversations 160]
        [--model smollm2] [--dtype float32] [--device auto]

Prints a table, then `target_top1_mean=<mean top-1 probability>` last.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from eagletrain.data.samples import DataSamples
from eagletrain.runtime.rundir import reopen_run
from eagletrain.target import load_target, pick_device, resolve_target


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--conversations", type=int, default=160)
    parser.add_argument("--model", default=None, help="default: the run's target")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    run = reopen_run(args.run_dir)
    target_cfg = run.config.target
    if args.model:
        target_cfg = target_cfg.model_copy(update={"model": args.model})
    device = pick_device(args.device)
    model = load_target(resolve_target(target_cfg), args.dtype, device).eval()
    samples = DataSamples(run)
    keys = [k for k, row in samples.rows.items() if row.split == "heldout"]
    top1, entropy, started = [], [], time.monotonic()
    for key in keys[: args.conversations]:
        ids, mask = samples.get(key)
        logits = model(ids.long()[None].to(device)).logits[0].float()
        # position i predicts token i + 1: the reply positions are those whose next token
        # is an assistant (loss-masked) token
        p = torch.softmax(logits[:-1][mask[1:].bool().to(device)], dim=-1)
        top1.append(p.max(-1).values.cpu())
        entropy.append(-(p * p.clamp_min(1e-12).log()).sum(-1).cpu())
    t, e = torch.cat(top1), torch.cat(entropy)
    table = Table(
        title=f"the target on its own replies: {min(len(keys), args.conversations)} held-out "
        f"conversations, {args.dtype} on {device}, {time.monotonic() - started:.0f} s"
    )
    for column in ("reply positions", "top-1 mean", "top-1 median", "top-1 < 0.5",
                   "top-1 < 0.3", "entropy mean (nats)", "entropy median"):  # fmt: skip
        table.add_column(column, justify="right")
    table.add_row(
        f"{t.numel():,}", f"{t.mean():.3f}", f"{t.median():.3f}",
        f"{(t < 0.5).float().mean():.1%}", f"{(t < 0.3).float().mean():.1%}",
        f"{e.mean():.2f}", f"{e.median():.2f}",
    )  # fmt: skip
    Console(width=160).print(table)
    print(f"target_top1_mean={t.mean():.3f}")


if __name__ == "__main__":
    main()
