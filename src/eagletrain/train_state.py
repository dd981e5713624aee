"""Exact-resume checkpoints of a training run: model, optimizer, scheduler, RNG and the data
position, written as safetensors + JSON (no pickle) into a directory that appears
atomically; the ledger names the latest one, so a kill at any moment resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from eagletrain.shards import fsync_dir


@dataclass(frozen=True)
class Position:
    step: int  # optimizer steps done
    epoch: int
    batch: int  # batches of `epoch` done


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], Any]:
    state = optimizer.state_dict()
    tensors = {
        f"state.{pid}.{name}": value.detach().cpu().contiguous()
        for pid, entries in state["state"].items()
        for name, value in entries.items()
    }
    groups = [
        {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
        for g in state["param_groups"]
    ]
    return tensors, groups


def save_train_state(
    train_dir: Path,
    position: Position,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> str:
    name = f"resume-{position.step:08d}"
    tmp = train_dir / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
        tmp / "model.safetensors",
    )
    opt_tensors, groups = _optimizer_tensors(optimizer)
    opt_tensors["rng.torch"] = torch.get_rng_state()
    save_file(opt_tensors, tmp / "optimizer.safetensors")
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    meta = {"position": position.__dict__, "param_groups": groups, "scheduler": sched}
    (tmp / "state.json").write_text(json.dumps(meta))
    for f in tmp.iterdir():
        with f.open("rb") as fh:
            os.fsync(fh.fileno())
    final = train_dir / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(train_dir)
    return name


def load_train_state(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> Position:
    device = next(model.parameters()).device
    model.load_state_dict(load_file(path / "model.safetensors", device=str(device)), strict=True)
    tensors = load_file(path / "optimizer.safetensors", device=str(device))
    meta = json.loads((path / "state.json").read_text())
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, pid, name = key.split(".", 2)
            state.setdefault(int(pid), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    scheduler.load_state_dict({**meta["scheduler"], "lr_lambdas": [None]})
    torch.set_rng_state(tensors["rng.torch"].cpu())
    return Position(**meta["position"])


def remove_older(train_dir: Path, keep: str) -> None:
    for old in train_dir.glob("resume-*"):
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines (steps and evaluations) written after the checkpoint we resume
    from, so none appears twice."""
    if not path.is_file():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line and json.loads(line).get("step", 0) <= step
    ]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
