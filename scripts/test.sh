#!/usr/bin/env bash
# Installs everything (scripts/install.sh), then lints and runs the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/ruff check src tests bench gpu
.venv/bin/ruff format --check src tests bench gpu
.venv/bin/python -m pytest -q
