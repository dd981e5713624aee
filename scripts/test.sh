#!/usr/bin/env bash
# Installs everything (scripts/install.sh; the vLLM venv of the `-m vllm` tests,
# scripts/vllm_venv.sh, alongside it), then lints and runs the whole test suite on the CPU,
# a module per worker on two workers (pytest-xdist: many tests wait on subprocesses,
# servers and kills). The venv is waited for before the tests: built while they ran, it
# slowed them more than it saved (2026-12-06: 29.1 min in all against ~27).
set -euo pipefail
cd "$(dirname "$0")/.."
vllm_log=$(mktemp)
bash scripts/vllm_venv.sh > "$vllm_log" 2>&1 &
vllm_venv=$!
bash scripts/install.sh
.venv/bin/ruff check src tests bench gpu
.venv/bin/ruff format --check src tests bench gpu
if ! wait "$vllm_venv"; then
  echo "scripts/vllm_venv.sh failed:" >&2
  tail -20 "$vllm_log" >&2
  exit 1
fi
.venv/bin/python -m pytest -q -n 2 --dist loadscope --durations=15
