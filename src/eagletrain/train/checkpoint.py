"""The trained drafter's checkpoint (train/checkpoint): the best held-out state, saved by
training and read by export. Exact-resume state is train/state.py's."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagletrain.drafter import Eagle3Drafter

CHECKPOINT = "checkpoint"
DRAFTER_CONFIG = "drafter_config.json"  # also in each exact-resume state (train/state.py)


def save_checkpoint(
    directory: Path, state: dict[str, torch.Tensor], drafter: Eagle3Drafter, extra: dict[str, Any]
) -> str:
    """`state`: the drafter's whole state dict (sharding.full_model_state)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "model.safetensors.tmp"
    save_file(state, tmp)
    tmp.replace(directory / "model.safetensors")
    config = drafter.config.to_dict()
    (directory / DRAFTER_CONFIG).write_text(json.dumps(config, indent=2))
    (directory / "train_summary.json").write_text(json.dumps(extra, indent=2))
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()[:32]


def load_checkpoint(directory: Path) -> Eagle3Drafter:
    """The drafter in `directory`: train/checkpoint or an exact-resume state."""
    cfg = LlamaConfig(**json.loads((directory / DRAFTER_CONFIG).read_text()))
    drafter = Eagle3Drafter(cfg)
    drafter.load_state_dict(load_file(directory / "model.safetensors"), strict=True)
    return drafter
