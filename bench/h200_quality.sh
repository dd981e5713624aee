#!/usr/bin/env bash
# The H200 quality run (issue 8), device tool call 2 (and later calls while the machine is
# warm: every stage resumes). Call 1 must have put .carry/a/gguf.part.aa into /tmp/m.
# Assembles the SmolLM2 GGUF, runs configs/smollm2-h200.toml into /tmp/q, then
# bench/decode.py on it; brings metrics, eval results and logs back under $OUT.
#   PHASE=pipeline (default) | decode | all
set -uo pipefail
[ -f /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf ] || cat /tmp/m/gguf.part.aa .carry/b/gguf.part.ab > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --upgrade --no-index --no-deps --target /tmp/site .carry/b/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src EAGLETRAIN_CACHE=/tmp/cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
# short sequences: the dense TTT attention (flex compiles a kernel per sequence length)
export EAGLETRAIN_TTT_ATTENTION="${EAGLETRAIN_TTT_ATTENTION:-dense}"
M=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
C=$PWD/.carry/c
SETS=(--set target.model="$M" --set data.source="$C/sharegpt_3000.jsonl.gz" --set eval.dataset="$C/question.jsonl")
PHASE="${PHASE:-pipeline}"
if [ "$PHASE" != decode ]; then
  start=$(date +%s)
  timeout "${PIPELINE_S:-480}" python3 -m eagletrain run configs/smollm2-h200.toml --run-dir /tmp/q "${SETS[@]}" 2>&1 \
    | grep -v "━" | tail -30 | tee -a $OUT/pipeline.log
  echo "pipeline_call_wall_s=$(( $(date +%s) - start ))" | tee -a $OUT/pipeline.log
fi
python3 -m eagletrain status /tmp/q | tee $OUT/status.txt
python3 - <<'PY' | tee $OUT/stage_seconds.txt
import sqlite3
c = sqlite3.connect("/tmp/q/ledger.sqlite")
for stage, a, b in c.execute("SELECT stage, started_at, finished_at FROM stages"):
    print(f"stage_seconds {stage} {(b or a) - a:.1f}")
PY
if [ "$PHASE" != pipeline ]; then
  python3 bench/decode.py /tmp/q --model "$M" --datasets "$C/question.jsonl,$C/HumanEval.jsonl.gz,heldout" \
    --temperatures 0 --prompts "${PROMPTS:-8}" --max-new 128 2>&1 | grep -v -i "warn\|━" | tee $OUT/decode_t0.log
  python3 bench/decode.py /tmp/q --model "$M" --datasets "$C/question.jsonl" \
    --temperatures 1 --prompts "${PROMPTS:-8}" --max-new 128 2>&1 | grep -v -i "warn\|━" | tee $OUT/decode_t1.log
fi
for f in eval/results.json train/metrics.jsonl train/checkpoint/train_summary.json data/summary.json; do
  [ -f /tmp/q/$f ] && cp /tmp/q/$f $OUT/$(echo $f | tr / _)
done
exit 0
