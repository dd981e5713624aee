"""The extracted dataset's metadata (hidden/dataset.json): which target, which layers in
which convention, which dtypes. Extraction writes it; training and online training read or
rebuild it the same way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagletrain.errors import ConfigError, InputError
from eagletrain.runtime.rundir import Run
from eagletrain.target import LAYER_ID_CONVENTION, default_aux_layer_ids

DATASET_META = "dataset.json"


def dataset_metadata(
    run: Run, cfg: Any, identity: str, tmpl: str, aux_ids: list[int]
) -> dict[str, Any]:
    """`cfg`: the target's HF config."""
    return {
        "target": identity,
        "template_hash": tmpl,
        "aux_layer_ids": aux_ids,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "last_hidden": f"output of layer {cfg.num_hidden_layers - 1}, before the final norm",
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "store_dtype": run.config.extract.store_dtype,
        "compute_dtype": run.config.target.dtype,
        "source": (
            f"engine dumps ({run.config.extract.engine.convention} layer ids)"
            if run.config.extract.backend == "engine"
            else "transformers forward hooks"
        ),
    }


def resolve_aux_ids(run: Run, num_layers: int) -> list[int]:
    aux = run.config.extract.aux_layer_ids or default_aux_layer_ids(num_layers)
    if len(aux) != 3 or any(not 0 <= i < num_layers for i in aux):
        raise ConfigError(f"extract.aux_layer_ids {aux}: need 3 layer ids in [0, {num_layers - 1}]")
    return list(aux)


def read_dataset_metadata(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "hidden" / DATASET_META
    if not path.is_file():
        raise InputError(f"{path}: no extracted dataset metadata")
    return json.loads(path.read_text())
