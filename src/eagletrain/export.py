"""Stage 4a, export: the SGLang/EAGLE checkpoint format, round-tripped before it counts.

SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` as "output of layer k"
(it captures the residual stream before layer k+1), which is eagletrain's own convention,
so the ids are written unchanged. A key that does not match on load would silently give
random weights in an engine (speculators#1114): `load_exported` fails on any mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagletrain.drafter import Eagle3Drafter
from eagletrain.errors import EagletrainError, InputError
from eagletrain.rundir import Run, require_previous
from eagletrain.train import CHECKPOINT
from eagletrain.worker import WorkerSession

STAGE = "export"
SGLANG_DIR = "sglang"


class ExportError(EagletrainError):
    """An exported checkpoint does not load back exactly."""

    exit_code = 6


def sglang_config(drafter: Eagle3Drafter) -> dict[str, Any]:
    cfg = drafter.config.to_dict()
    aux = list(cfg.pop("eagle_aux_layer_ids"))
    for key in ("architectures", "transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        cfg.pop(key, None)
    return {
        **cfg,
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "torch_dtype": "float32",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": aux,
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
        },
    }


def write_sglang(drafter: Eagle3Drafter, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(sglang_config(drafter), indent=2))


def load_exported(directory: Path) -> Eagle3Drafter:
    """Build a drafter from an exported directory; any missing or unexpected tensor, or a
    shape that disagrees with the config, is an error naming it."""
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise InputError(f"{directory}: not an exported drafter (config.json, model.safetensors)")
    raw = json.loads(config_path.read_text())
    eagle = raw.pop("eagle_config", {})
    raw["eagle_aux_layer_ids"] = eagle.get("eagle_aux_hidden_state_layer_ids")
    for key in ("draft_vocab_size", "target_hidden_size"):
        if key not in raw:
            raise ExportError(f"{config_path}: missing {key}")
    drafter = Eagle3Drafter(LlamaConfig(**raw))
    state = load_file(weights_path)
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ExportError(
            f"{weights_path}: tensor names do not match the drafter: "
            f"missing {missing}, unexpected {unexpected}"
        )
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise ExportError(
                f"{weights_path}: {name} has shape {tuple(tensor.shape)}, "
                f"config implies {tuple(expected[name].shape)}"
            )
    drafter.load_state_dict(state, strict=True)
    return drafter


def load_checkpoint(directory: Path) -> Eagle3Drafter:
    cfg = LlamaConfig(**json.loads((directory / "drafter_config.json").read_text()))
    drafter = Eagle3Drafter(cfg)
    drafter.load_state_dict(load_file(directory / "model.safetensors"), strict=True)
    return drafter


def serve_commands(export_dir: Path, target: str) -> list[str]:
    d = export_dir.resolve()
    return [
        f"python -m sglang.launch_server --model-path {target} "
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {d} "
        "--speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4",
    ]


def run_export(run: Run, allow_partial: bool = False) -> Path:
    ledger = run.ledger
    out_dir = run.dir / "export" / SGLANG_DIR
    if ledger.completion(STAGE) is not None:
        return out_dir
    require_previous(run, STAGE, allow_partial)
    ledger.begin_stage(STAGE, "units", 1, "checkpoints")
    with WorkerSession(ledger, run.dir, STAGE, "0/1"):
        drafter = load_checkpoint(run.dir / "train" / CHECKPOINT)
        tmp = out_dir.with_name(f".{SGLANG_DIR}.tmp")
        write_sglang(drafter, tmp)
        loaded = load_exported(tmp)
        for name, tensor in drafter.state_dict().items():
            if not torch.equal(tensor, loaded.state_dict()[name]):
                raise ExportError(f"{tmp}: {name} changed in the round trip")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
        digest = hashlib.sha256((out_dir / "model.safetensors").read_bytes()).hexdigest()[:32]
        ledger.set_units_done(STAGE, 1)
    ledger.complete(STAGE, 1, 0, digest, allow_partial, {"format": "sglang", "path": str(out_dir)})
    return out_dir
