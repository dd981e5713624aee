#!/usr/bin/env bash
# Installs everything (scripts/install.sh; the vLLM venv of the `-m vllm` tests,
# scripts/vllm_venv.sh, alongside it), then lints and runs the whole test suite on the CPU.
# One pytest process: two xdist workers measured 25.0, 27.7 and 34.4 min here against 26
# serially (2026-12-06; two torch processes on 2 cores oversubscribe them).
set -euo pipefail
cd "$(dirname "$0")/.."
vllm_log=$(mktemp)
bash scripts/vllm_venv.sh > "$vllm_log" 2>&1 &
vllm_venv=$!
bash scripts/install.sh
.venv/bin/ruff check src tests bench gpu scripts
.venv/bin/ruff format --check src tests bench gpu scripts
if ! wait "$vllm_venv"; then
  echo "scripts/vllm_venv.sh failed:" >&2
  tail -20 "$vllm_log" >&2
  exit 1
fi
.venv/bin/python -m pytest -q --durations=15
