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

from eagletrain.runtime.shards import fsync_dir
from eagletrain.train.checkpoint import DRAFTER_CONFIG
from eagletrain.train.sharding import is_sharded, load_full_model_state, load_full_optimizer_state


@dataclass(frozen=True)
class Position:
    step: int  # optimizer steps done
    epoch: int
    batch: int  # batches of `epoch` done


def _optimizer_tensors(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], Any]:
    """Flatten an optimizer state dict (parameters keyed by index, or by name under FSDP)."""
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
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler: Any,
    drafter_config: dict[str, Any],
) -> str:
    """Write whole states (sharding.full_model_state / full_optimizer_state) atomically, with
    the drafter's config, so that export can take these weights (export.weights = "latest")."""
    name = f"resume-{position.step:08d}"
    tmp = train_dir / f".{name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(model_state, tmp / "model.safetensors")
    opt_tensors, groups = _optimizer_tensors(optimizer_state)
    opt_tensors["rng.torch"] = torch.get_rng_state()
    save_file(opt_tensors, tmp / "optimizer.safetensors")
    sched = {k: v for k, v in scheduler.state_dict().items() if k != "lr_lambdas"}
    meta = {"position": position.__dict__, "param_groups": groups, "scheduler": sched}
    (tmp / "state.json").write_text(json.dumps(meta))
    (tmp / DRAFTER_CONFIG).write_text(json.dumps(drafter_config, indent=2))
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
    """Restore model, optimizer, scheduler and RNG (through sharding.py under FSDP)."""
    model_state = load_file(path / "model.safetensors")
    device = next(model.parameters()).device
    tensors = load_file(path / "optimizer.safetensors")
    meta = json.loads((path / "state.json").read_text())
    state: dict[int | str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            pid, name = key.removeprefix("state.").rsplit(".", 1)
            state.setdefault(int(pid) if pid.isdigit() else pid, {})[name] = value
    if not is_sharded(model):  # plain modules load straight onto their device
        model_state = {k: v.to(device) for k, v in model_state.items()}
        state = {k: {n: v.to(device) for n, v in e.items()} for k, e in state.items()}
    load_full_model_state(model, model_state)
    load_full_optimizer_state(
        model, optimizer, {"state": state, "param_groups": meta["param_groups"]}
    )
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
