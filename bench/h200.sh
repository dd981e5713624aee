#!/usr/bin/env bash
# One H200 session (device tool, call 2 of 2; ../shared/reference/GPU.md): assemble the
# SmolLM2 GGUF, install the few wheels the image lacks, then run the demo pipeline on the
# GPU in bf16 and the extraction benchmark (shards on disk and in memory). Logs to $OUT.
set -uo pipefail
[ -f /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /tmp/m/gguf.part.aa .carry/b/gguf.part.ab > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/b/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src EAGLETRAIN_CACHE=/tmp/cache PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
M="/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf"
# The image has no data-carrier packages: carried files stand in for them (same content).
DATA="${DATA:-$PWD/.carry/c/sharegpt_2500.jsonl.gz}"
PROMPTS="${PROMPTS:-$PWD/.carry/c/question.jsonl}"
start=$(date +%s)
[ -n "${SKIP_DEMO:-}" ] || python3 -m eagletrain run configs/smollm2-demo.toml --run-dir /tmp/demo \
  --set target.model="$M" --set target.dtype=bfloat16 --set data.source="$DATA" \
  --set eval.dataset="$PROMPTS" 2>&1 | grep -v "━" | tee $OUT/demo.log
echo "demo_wall_s=$(( $(date +%s) - start ))" | tee -a $OUT/demo.log
python3 -m eagletrain status /tmp/demo | tee -a $OUT/demo.log
python3 - <<'PY' | tee -a $OUT/demo.log
import sqlite3
c = sqlite3.connect("/tmp/demo/ledger.sqlite")
for stage, a, b in c.execute("SELECT stage, started_at, finished_at FROM stages"):
    print(f"stage_seconds {stage} {(b or a) - a:.1f}")
PY
cp /tmp/demo/eval/results.json $OUT/demo_eval.json 2>/dev/null
cp /tmp/demo/train/metrics.jsonl $OUT/demo_metrics.jsonl 2>/dev/null
for out in /tmp /dev/shm; do
  python3 bench/extract.py --model "$M" --source "$DATA" --dtype bfloat16 --samples 1536 --max-length 1024 \
    --batch-tokens 32768 --out $out --repeats 3 2>&1 | grep -v -i "warn\|Loading\|━" | tail -5 \
    | tee -a $OUT/extract.log
done
