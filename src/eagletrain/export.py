"""Stage 4a, export: checkpoints that SGLang and vLLM load, each round-tripped before it counts.

Formats (tensors are the drafter's state_dict, renamed where a format says so):

- `sglang`: LlamaForCausalLMEagle3, decoder layer `midlayer.*`, aux layer ids in
  `eagle_config.eagle_aux_hidden_state_layer_ids` as output-of-layer-k (ours, unchanged),
  and the same layers in vLLM's convention at the top level, so vLLM serving this folder
  reads them right too (it reads eagle_config's ids as its own, one layer early).
- `vllm`: the same tensors (vLLM remaps `midlayer.` to `layers.0.`), aux ids in a top-level
  `eagle_aux_hidden_state_layer_ids` in vLLM's input-of-layer convention = ours + 1.
- `speculators`: Eagle3Speculator, `layers.0.*`, `transformer_layer_config`,
  `speculators_config`, top-level aux ids in vLLM's convention = ours + 1.

vLLM falls back to its default layers when the ids are missing (acceptance ~1%, a known
trap), so every format writes them explicitly. A key that does not match on load would
silently give random weights in an engine (speculators#1114): `load_exported` fails on any
missing, unexpected or mis-shaped tensor.
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
from eagletrain.runtime.rundir import Run, require_previous
from eagletrain.runtime.worker import WorkerSession
from eagletrain.train.checkpoint import CHECKPOINT, DRAFTER_CONFIG, load_checkpoint

STAGE = "export"
SGLANG_DIR = "sglang"
FORMATS = ("sglang", "vllm", "speculators")


class ExportError(EagletrainError):
    """An exported checkpoint does not load back exactly."""

    exit_code = 6


def to_vllm_layer_ids(ids: list[int]) -> list[int]:
    """Ours / SGLang: id k = output of layer k. vLLM: id k+1 = input of layer k+1 (same state)."""
    return [i + 1 for i in ids]


def from_vllm_layer_ids(ids: list[int]) -> list[int]:
    return [i - 1 for i in ids]


def _layer_config(drafter: Eagle3Drafter) -> dict[str, Any]:
    cfg = drafter.config.to_dict()
    for key in (
        "architectures",
        "transformers_version",
        "_name_or_path",
        "dtype",
        "torch_dtype",
        "eagle_aux_layer_ids",
    ):
        cfg.pop(key, None)
    return {**cfg, "model_type": "llama", "num_hidden_layers": 1}


def export_config(drafter: Eagle3Drafter, fmt: str, target: str) -> dict[str, Any]:
    aux = list(drafter.config.eagle_aux_layer_ids)
    layer = _layer_config(drafter)
    if fmt == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": layer["draft_vocab_size"],
            "target_hidden_size": layer["target_hidden_size"],
            "norm_before_residual": layer["norm_before_residual"],
            "eagle_aux_hidden_state_layer_ids": to_vllm_layer_ids(aux),
            "embed_requires_grad": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": target, "architectures": ["LlamaForCausalLM"]},
            },
        }
    config = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "torch_dtype": "float32"}
    if fmt == "sglang":
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": aux,
            "use_aux_hidden_state": True,
        }
        # vLLM reads a top-level field first and takes eagle_config's ids as its own
        # convention (one layer early); SGLang reads eagle_config first. With both, this
        # folder is read right by either engine
        config["eagle_aux_hidden_state_layer_ids"] = to_vllm_layer_ids(aux)
    else:
        config["eagle_aux_hidden_state_layer_ids"] = to_vllm_layer_ids(aux)
    return config


def _rename(state: dict[str, torch.Tensor], old: str, new: str) -> dict[str, torch.Tensor]:
    return {(new + k[len(old) :] if k.startswith(old) else k): v for k, v in state.items()}


def write_format(drafter: Eagle3Drafter, directory: Path, fmt: str, target: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    if fmt == "speculators":
        state = _rename(state, "midlayer.", "layers.0.")
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
    config = export_config(drafter, fmt, target)
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _read_config(config_path: Path) -> tuple[str, dict[str, Any], list[int] | None]:
    """(format, drafter LlamaConfig fields, aux ids in our convention) of an exported dir."""
    raw = json.loads(config_path.read_text())
    if raw.get("architectures") == ["Eagle3Speculator"]:
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        return (
            "speculators",
            dict(raw["transformer_layer_config"]),
            (from_vllm_layer_ids(ids) if ids else None),
        )
    if "eagle_config" in raw:
        ids = raw.pop("eagle_config").get("eagle_aux_hidden_state_layer_ids")
        for_vllm = raw.pop("eagle_aux_hidden_state_layer_ids", None)
        if for_vllm is not None and ids and for_vllm != to_vllm_layer_ids(ids):
            raise ExportError(
                f"{config_path}: eagle_config ids {ids} (SGLang) and top-level ids {for_vllm} "
                f"(vLLM) name different layers"
            )
        return "sglang", raw, ids
    ids = raw.pop("eagle_aux_hidden_state_layer_ids", None)
    return "vllm", raw, from_vllm_layer_ids(ids) if ids else None


def load_exported(directory: Path) -> Eagle3Drafter:
    """Build a drafter from an exported directory (any format); any missing, unexpected or
    mis-shaped tensor, or missing convention field, is an error naming it."""
    config_path, weights_path = directory / "config.json", directory / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise InputError(f"{directory}: not an exported drafter (config.json, model.safetensors)")
    fmt, fields, aux = _read_config(config_path)
    for key in ("draft_vocab_size", "target_hidden_size", "norm_before_residual"):
        if key not in fields:
            raise ExportError(f"{config_path}: missing {key}")
    if not aux or len(aux) != 3:
        raise ExportError(f"{config_path}: no explicit aux layer ids ({fmt} format)")
    drafter = Eagle3Drafter(LlamaConfig(**{**fields, "eagle_aux_layer_ids": aux}))
    state = load_file(weights_path)
    if fmt == "speculators":
        state = _rename(state, "layers.0.", "midlayer.")
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


def serve_commands(export_root: Path, target: str, steps: int = 3) -> list[str]:
    root = export_root.resolve()
    return [
        f"sglang: python -m sglang.launch_server --model-path {target} "
        f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {root / 'sglang'} "
        f"--speculative-num-steps {steps} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {steps + 1}",
        f"vllm: vllm serve {target} --speculative-config "
        f'\'{{"method": "eagle3", "model": "{root / "vllm"}", '
        f'"num_speculative_tokens": {steps}}}\'',
        f"vllm (speculators format): vllm serve {target} --speculative-config "
        f'\'{{"method": "eagle3", "model": "{root / "speculators"}", '
        f'"num_speculative_tokens": {steps}}}\'',
    ]


def _round_trip(drafter: Eagle3Drafter, directory: Path) -> None:
    loaded = load_exported(directory)
    if list(loaded.config.eagle_aux_layer_ids) != list(drafter.config.eagle_aux_layer_ids):
        raise ExportError(f"{directory}: aux layer ids changed in the round trip")
    for name, tensor in drafter.state_dict().items():
        if not torch.equal(tensor, loaded.state_dict()[name]):
            raise ExportError(f"{directory}: {name} changed in the round trip")


def run_export(run: Run, allow_partial: bool = False) -> Path:
    ledger = run.ledger
    root = run.dir / "export"
    if ledger.completion(STAGE) is not None:
        return root
    require_previous(run, STAGE, allow_partial)
    ledger.begin_stage(STAGE, "units", len(FORMATS), "formats")
    digests = {}
    with WorkerSession(ledger, run.dir, STAGE, "0/1"):
        weights = weights_to_export(run)
        drafter = load_checkpoint(run.dir / "train" / weights["directory"])
        for done, fmt in enumerate(FORMATS, 1):
            out_dir, tmp = root / fmt, root / f".{fmt}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            write_format(drafter, tmp, fmt, run.config.target.model)
            _round_trip(drafter, tmp)
            shutil.rmtree(out_dir, ignore_errors=True)
            os.replace(tmp, out_dir)
            digests[fmt] = hashlib.sha256((out_dir / "model.safetensors").read_bytes()).hexdigest()
            ledger.set_units_done(STAGE, done)
    digest = hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:32]
    detail = {"formats": list(FORMATS), "path": str(root), "weights": weights}
    ledger.complete(STAGE, len(FORMATS), 0, digest, allow_partial, detail)
    return root


def weights_to_export(run: Run) -> dict[str, Any]:
    """Which saved weights export takes (export.weights): the directory under train/, its
    step, whether a held-out evaluation chose it, and the newest step saved."""
    train_dir = run.dir / "train"
    detail = (run.ledger.stage_row("train") or {}).get("detail", {})
    saved = []
    if (train_dir / CHECKPOINT / "model.safetensors").is_file():
        summary = json.loads((train_dir / CHECKPOINT / "train_summary.json").read_text())
        saved.append({"directory": CHECKPOINT, "step": summary["steps"], "evaluated": True})
    resume = detail.get("resume")
    if resume and (train_dir / resume / DRAFTER_CONFIG).is_file():
        state = json.loads((train_dir / resume / "state.json").read_text())
        saved.append({"directory": resume, "step": state["position"]["step"], "evaluated": False})
    newest = max((w["step"] for w in saved), default=0)
    if run.config.export.weights == "best":
        saved = [w for w in saved if w["evaluated"]]
    if not saved:
        hint = f"; export.weights=latest takes step {newest}" if newest else ""
        raise InputError(f"{train_dir}: no held-out checkpoint to export yet{hint}")
    return {**max(saved, key=lambda w: w["step"]), "newest_step": newest}
