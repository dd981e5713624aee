#!/usr/bin/env bash
# One H200 session of the device tool (../shared/reference/GPU.md), in back-to-back calls
# while the machine stays warm (/tmp survives between them; 64 MiB travel per call):
#   PHASE=setup   carry .carry/a (GGUF first half), .carry/c (eval prompt files) and
#                 .carry/d (ShareGPT JSONL.gz): 65 MB together with the tree (
#                 gpu/pieces.sh builds .carry/a-d here); on a fresh machine, also
#                 (in another setup call when over 64 MiB) an earlier call's pieces:
#                 .carry/r (rundata.tgz.*), .carry/e (export_sglang.tgz.*), .carry/s
#                 (prompts.tgz.*: the scale run with its prompts written, gpu/kept.txt),
#                 .carry/t (rundata.tgz.*: the scale run's data stage part-way; in place of
#                 r and s)
#   PHASE=bench   carry .carry/b (GGUF second half + wheels): trainer and extraction benches
#   CFG (default configs/smollm2-h200.toml) and DATA_SOURCE (data.source) pick the run;
#   the scale run: CFG=configs/smollm2-scale.toml DATA_SOURCE='["/tmp/c/sharegpt_all.jsonl.gz","self"]'
#   PHASE=data    carry .carry/b and, to continue an earlier session's run, .carry/r (its
#                 rundata.tgz.* pieces): DECODER=auto first measures generate against
#                 the continuous decoder and takes the faster; regenerate + tokenize
#                 (configs/smollm2-h200.toml) until DATA_S seconds (then the turns in
#                 flight finish, for DRAIN_S at most), then bring the run's
#                 data stage back as $OUT/rundata.tgz.* (config, ledger, data shards; copy
#                 them into .carry/r here for the next session: a run directory is
#                 relocatable, tests/test_kill_resume.py)
#                 WARM_TRAIN=S: meanwhile a copy of the run trains for at most S seconds,
#                 to its third step, so that the training call's compile is cached
#   PHASE=prompts the data stage until its prompts (data.source "self") are written, then
#                 stopped: the ledger holding them comes back as $OUT/prompts.tgz.*
#   PHASE=regen   bench/regen_local.py: completion tokens/s per local decoder
#                 (REGEN_CONFIGS, DECODER/ROWS[/ATTENTION]) beside the KV-read limit
#   PHASE=engines bench/decode_engine.py: plain step, chain and tree cycle per engine
#                 (ENGINES, default compiled,static,eager);
#                 ENGINE_PROFILE=chain profiles a chain decode on each engine
#   PHASE=train   extract (skipped with train.online), train under torchrun until TRAIN_S
#                 seconds (the next call resumes), export once training is complete;
#                 ALLOW_PARTIAL=1 to go on with what an unfinished data stage holds
#                 (EXPORT_PARTIAL=1: export an unfinished run's newest weights); pieces
#                 of the export past one call's 64 MB come back with PHASE=fetch
#   PHASE=firststep the trainer's cold start on a copy of the run: seconds to its first steps
#   PHASE=trainbench bench/train_online.py on the run in /tmp/q (VARIANTS, STEPS): the
#                 online trainer's batch and step times, and a kernel table
#   PHASE=ablation bench/recipe_ablation.py on the run in /tmp/q (a data stage, not yet
#                 trained: .carry/r): ABLATION, ';'-separated NAME:key=value ... variants
#                 of the train section, trained side by side (ABLATION_PARALLEL at a
#                 time; default all) for ABLATION_S seconds each (a later call resumes
#                 them), each judged by its held-out evaluations; ABLATION_EXPORT=NAME,...
#                 exports those variants and brings their drafters back in pieces
#   PHASE=decode  bench/decode.py on ENGINES (default compiled,eager): MT-bench, HumanEval
#                 and held-out at T=0 and 1, chain 3 and tree, each speedup against plain
#                 decoding on the same engine; the JSON results come back as one tgz
# Everything a phase measures lands in $OUT (logs, JSON), the run itself in /tmp/q.
set -uo pipefail
PHASE="${PHASE:?set PHASE}"
mkdir -p /tmp/m /tmp/c
if [ "$PHASE" = setup ]; then
  # whatever is carried: the GGUF's first half, prompt files, ShareGPT, and (to continue on
  # a fresh machine) an earlier call's run pieces: rundata.tgz.* and export_sglang.tgz.*
  [ -d .carry/a ] && cp .carry/a/gguf.part.aa /tmp/m/
  for d in c d; do [ -d .carry/$d ] && cp .carry/$d/* /tmp/c/; done
  mkdir -p /tmp/q
  for p in r/rundata t/rundata e/export_sglang s/prompts; do
    # removed once unpacked: carried paths stay on the machine for later calls, and a later
    # setup would unpack them again over another run (2026-12-06)
    if ls .carry/$p.tgz.* >/dev/null 2>&1; then
      cat .carry/$p.tgz.* | tar -C /tmp/q -xzf - || exit 1
      rm -f .carry/$p.tgz.*
    fi
  done
  ls -la /tmp/m /tmp/c /tmp/q
  exit 0
fi
M=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f $M ] || cat /tmp/m/gguf.part.aa .carry/b/gguf.part.ab > $M
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $M" | sha256sum -c || exit 1
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/b/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src EAGLETRAIN_CACHE=/tmp/cache PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
DATA_FILE="${DATA_FILE:-sharegpt_all.jsonl.gz}"
# DATA_SOURCE: the data.source override (the scale run: '["/tmp/c/sharegpt_all.jsonl.gz","self"]')
SETS=(--set target.model="$M" --set data.source="${DATA_SOURCE:-/tmp/c/$DATA_FILE}" --set eval.datasets=[\"/tmp/c/question.jsonl\"])
# EXTRA_SETS: more overrides (a dry run on a CPU: smaller, float32)
read -r -a EXTRA <<< "${EXTRA_SETS:-}"
SETS+=("${EXTRA[@]}")
# OPENINGS: data.prompts.openings as one TOML list (its strings hold spaces, which
# EXTRA_SETS splits on): '["Write a short story", "In physics, explain"]'
[ -n "${OPENINGS:-}" ] && SETS+=(--set "data.prompts.openings=${OPENINGS}")
CFG=${CFG:-configs/smollm2-h200.toml}
# a trainer on the run copy $1 (process $2): waited for until its third step is logged
# (every graph of a step compiled) or it exits, then stopped ($3 s between INT and KILL)
stop_after_three_steps() {
  until [ "$(cat "$1/train/metrics.jsonl" 2>/dev/null | wc -l)" -ge 3 ]; do
    kill -0 "$2" 2>/dev/null || break
    sleep 2
  done
  pkill -INT -f "run-dir $1"; sleep "$3"; pkill -KILL -f "run-dir $1"
}
# the SGLang export of run directory $1 as pieces $2.tgz.* in /tmp/pieces, under the 16 MiB
# a file that come back
pack_export() {
  mkdir -p /tmp/pieces
  [ -d "$1/export/sglang" ] && tar -C "$1" -czf - export/sglang | split -b 15M - "/tmp/pieces/$2.tgz."
}
# the first four waiting pieces to $OUT (a call brings back 64 MB); the rest wait for PHASE=fetch
send_pieces() {
  ls /tmp/pieces/* 2>/dev/null | head -4 | xargs -r -I{} mv {} $OUT/
  ls /tmp/pieces
}
ledger_times() {
  python3 -m eagletrain status /tmp/q | tee -a $OUT/$1
  python3 - <<'PY' | tee -a $OUT/$1
import sqlite3
c = sqlite3.connect("/tmp/q/ledger.sqlite")
for stage, a, b in c.execute("SELECT stage, started_at, finished_at FROM stages"):
    last = c.execute("SELECT max(finished_at) FROM items WHERE stage=?", (stage,)).fetchone()[0]
    print(f"stage_seconds {stage} {(b or last or a) - a:.1f}")
PY
}
case "$PHASE" in
bench)
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())' | tee $OUT/train_bench.log
  timeout 250 python3 bench/train.py --attention flex --recompute off,on --compile off,on \
    --batches 8,16 --iters 3 2>&1 | grep -v -i "warn" | tee -a $OUT/train_bench.log
  for spec in "bfloat16 /tmp" "float8_e4m3fn /tmp" "bfloat16 /dev/shm"; do
    set -- $spec
    timeout 95 python3 bench/extract.py --model "$M" --source /tmp/c/$DATA_FILE \
      --dtype bfloat16 --store-dtype $1 --samples 1024 --max-length 1024 --batch-tokens 32768 \
      --out $2 --repeats 2 --writer-threads 8 2>&1 | grep -v -i "warn\|Loading\|━\|Convert\|Writing" \
      | tail -6 | tee -a $OUT/extract_bench.log
  done ;;
data)
  [ -f /tmp/c/$DATA_FILE ] || cp .carry/d/$DATA_FILE /tmp/c/ || exit 1
  if [ ! -d /tmp/q ] && ls .carry/r/rundata.tgz.* >/dev/null 2>&1; then
    mkdir -p /tmp/q && cat .carry/r/rundata.tgz.* | tar -C /tmp/q -xzf - || exit 1
    python3 -m eagletrain status /tmp/q | head -3 | tee $OUT/restored.log
  fi
  # DECODER=auto first measures generate against the continuous decoder (flex attention)
  # on the same first turns (bench/regen_local.py; warm-ups untimed) and regenerates with
  # the faster; DECODER=generate|graphed|continuous picks one; unset, the config's
  start=$SECONDS
  decoder=${DECODER:-}
  # the scale config's refill policy (docs/benchmarks.md, 2026-12-07)
  CONTINUOUS=continuous/1024/flex/eager/refill=256/prefill=64/check=16
  if [ "$decoder" = auto ]; then
    timeout "${REGEN_S:-240}" python3 bench/regen_local.py --model "$M" --source /tmp/c/$DATA_FILE \
      --dtype "${DTYPE:-bfloat16}" --prompts "${REGEN_PROMPTS:-1024}" \
      --max-tokens "${MAX_NEW:-256}" --configs generate/512,$CONTINUOUS \
      2>&1 | grep -v -i "warn\|━" | tee $OUT/regen_bench.log
    rate() { sed -n "s|^row $1 .* tok_s=\([0-9]*\) .*|\1|p" $OUT/regen_bench.log; }
    generate=$(rate generate/512) continuous=$(rate $CONTINUOUS)
    decoder=generate
    if [ "${continuous:-0}" -gt "${generate:-0}" ]; then
      decoder=continuous
      SETS+=(--set data.regen.continuous_attention=flex)
    fi
    echo "decoder=$decoder (generate ${generate:-none} tok/s, continuous ${continuous:-none})" | tee -a $OUT/regen_bench.log
  fi
  [ -n "$decoder" ] && SETS+=(--set "data.regen.decoder=$decoder")
  # at DATA_S from the call's start a first SIGINT: no new turn, the turns in flight finish
  # (a batch or two); DRAIN_S later a second: stop now (finished turns are kept). Then the
  # run's data stage comes back
  # WARM_TRAIN=S: the trainer's first step compiles for ~280 s on a cold machine (H100,
  # 2026-12-06); a copy of the run so far trains beside the data stage (after its decoder
  # has its memory) for at most S seconds, so the training call finds the kernels cached
  [ -n "${WARM_TRAIN:-}" ] && { rm -rf /tmp/qwarm; cp -r /tmp/q /tmp/qwarm; }
  python3 -m eagletrain data $CFG --run-dir /tmp/q "${SETS[@]}" > /tmp/data_call.log 2>&1 &
  pid=$!
  if [ -n "${WARM_TRAIN:-}" ]; then
    ( sleep 60; exec timeout -k 10 -s INT "$WARM_TRAIN" torchrun --nproc_per_node 1 \
      --master_port 29611 -m eagletrain train $CFG --run-dir /tmp/qwarm "${SETS[@]}" \
      --allow-partial ) > /tmp/warm_train.log 2>&1 &
    warm=$!
  fi
  left=$(( ${DATA_S:-420} - (SECONDS - start) ))
  ( sleep $(( left > 30 ? left : 30 )); kill -INT $pid; sleep "${DRAIN_S:-45}"; kill -INT $pid ) >/dev/null 2>&1 &
  timer=$!
  wait $pid
  pkill -P $timer; kill $timer 2>/dev/null
  if [ -n "${WARM_TRAIN:-}" ]; then
    stop_after_three_steps /tmp/qwarm $warm 15
    echo "warm-up training: $(wc -l < /tmp/qwarm/train/metrics.jsonl 2>/dev/null) steps" \
      "logged, first at $(head -c 80 /tmp/qwarm/train/metrics.jsonl 2>/dev/null)" | tee $OUT/warm_train.log
    rm -rf /tmp/qwarm
  fi
  grep -v "━\|Converting" /tmp/data_call.log | tail -5 | tee $OUT/data.log
  ledger_times data.log
  # PIECES=ledger: the ledger and config only (the written prompts; no data chunks);
  # PIECES=slim: everything, the ledger without the texts of the conversations no longer
  # pending (their tokens are in the chunks: what .carry/t keeps). Pieces past the fourth
  # (one call brings back 64 MB) wait in /tmp/pieces for PHASE=fetch
  what="config.toml ledger.sqlite data"
  [ "${PIECES:-}" = ledger ] && what="config.toml ledger.sqlite"
  if [ "${PIECES:-}" = slim ]; then
    rm -rf /tmp/slim && mkdir -p /tmp/slim && cp /tmp/q/config.toml /tmp/slim/
    python3 - <<'PY'
import sqlite3
src, dst = sqlite3.connect("/tmp/q/ledger.sqlite"), sqlite3.connect("/tmp/slim/ledger.sqlite")
src.backup(dst)
dst.execute("DELETE FROM regenerated WHERE key IN "
            "(SELECT key FROM items WHERE stage='data' AND state != 'pending')")
dst.commit()
dst.execute("VACUUM")
PY
    tar -C /tmp/slim -czf - config.toml ledger.sqlite -C /tmp/q data | split -b 15M - $OUT/rundata.tgz.
  elif [ "${PIECES:-}" != none ]; then
    tar -C /tmp/q -czf - $what | split -b 15M - $OUT/rundata.tgz.
  fi
  mkdir -p /tmp/pieces
  ls $OUT/rundata.tgz.* 2>/dev/null | tail -n +5 | xargs -r mv -t /tmp/pieces/
  ls -l $OUT/rundata.tgz.* /tmp/pieces/ 2>/dev/null | tee -a $OUT/data.log ;;
train)
  # extract (skipped by the stage itself when train.online), then train until TRAIN_S
  # seconds: a stop saves the step in flight and the next call resumes; export when done
  python3 -m eagletrain extract $CFG --run-dir /tmp/q "${SETS[@]}" ${ALLOW_PARTIAL:+--allow-partial} 2>&1 | grep -v "━" | tail -5 | tee $OUT/train.log
  # -k: torchrun once sat out a call after its stop (2026-12-06): killed 20 s after the stop
  timeout -k 20 -s INT "${TRAIN_S:-540}" torchrun --nproc_per_node 1 -m eagletrain train $CFG --run-dir /tmp/q "${SETS[@]}" ${ALLOW_PARTIAL:+--allow-partial} 2>&1 | grep -v "━" | tail -8 | tee -a $OUT/train.log
  # EXPORT_PARTIAL=1: export an unfinished training's newest weights (a last call; its
  # best held-out checkpoint can be an epoch older: 1,886 steps on 2026-12-07)
  python3 -m eagletrain export $CFG --run-dir /tmp/q "${SETS[@]}" \
    ${EXPORT_PARTIAL:+--allow-partial --set export.weights=latest} 2>&1 | grep -v "━" | tail -5 | tee -a $OUT/train.log
  ledger_times train.log
  cp /tmp/q/train/metrics.jsonl /tmp/q/train/checkpoint/train_summary.json /tmp/q/train/profile-*.txt $OUT/ 2>/dev/null
  # the exported drafter in SGLang's format, in pieces under the 16 MiB a file that come
  # back; a call brings back 64 MB, so pieces past the fourth wait for PHASE=fetch
  if [ -d /tmp/q/export/sglang ]; then
    rm -rf /tmp/pieces
    pack_export /tmp/q export_sglang
    send_pieces | tee -a $OUT/train.log
  fi ;;
firststep)
  # the trainer's cold start on a copy of the run (--allow-partial, a part-way data stage
  # will do): seconds from the loop's start to each of its first steps, i.e. the compile of
  # every graph of a step; stopped after its third step or FIRST_S seconds
  rm -rf /tmp/qfirst && cp -r /tmp/q /tmp/qfirst
  timeout -k 10 -s INT "${FIRST_S:-300}" torchrun --nproc_per_node 1 --master_port 29612 \
    -m eagletrain train $CFG --run-dir /tmp/qfirst "${SETS[@]}" --allow-partial > /tmp/first.log 2>&1 &
  stop_after_three_steps /tmp/qfirst $! 10
  grep -v "━" /tmp/first.log | tail -4 | tee $OUT/firststep.log
  python3 -c 'import json,sys; [print("step", r["step"], "at", round(r["time"], 1), "s after the loop began") for r in map(json.loads, open(sys.argv[1]))]' \
    /tmp/qfirst/train/metrics.jsonl 2>&1 | head -5 | tee -a $OUT/firststep.log
  rm -rf /tmp/qfirst ;;
fetch)
  # what an earlier call left waiting in /tmp/pieces (over one call's 64 MB)
  send_pieces ;;
ablation)
  IFS=';' read -r -a specs <<< "${ABLATION:?set ABLATION, e.g. base:;ttt3:train.ttt_steps=3}"
  args=(); for v in "${specs[@]}"; do args+=(--variant "$v"); done
  # memory and load of the card every 10 s: how many trainers fit beside each other
  nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu --format=csv -l 10 > $OUT/gpu_use.csv &
  smi=$!
  python3 bench/recipe_ablation.py /tmp/q "${args[@]}" --seconds "${ABLATION_S:-480}" \
    --parallel "${ABLATION_PARALLEL:-0}" --stall-seconds "${STALL_S:-240}" "${SETS[@]}" 2>&1 | grep --line-buffered -v -i "warn" | tee $OUT/ablation.log
  kill $smi
  sort -t, -k2 -n $OUT/gpu_use.csv | tail -1 | sed 's/^/peak memory sample: /'
  for d in /tmp/q.ablation/*/; do
    gzip -c "$d/train/metrics.jsonl" > "$OUT/metrics-$(basename "$d").jsonl.gz"
    gzip -c "$d/train/heldout_rows.jsonl" > "$OUT/heldout_rows-$(basename "$d").jsonl.gz"
  done
  # ABLATION_EXPORT: variants (comma-separated) to export once trained, each with its own
  # resolved config, so that they can be served on the CPU (bench/decode.py): their SGLang
  # folders come back as export-NAME.tgz.* pieces, past the fourth with PHASE=fetch
  if [ -n "${ABLATION_EXPORT:-}" ]; then
    rm -rf /tmp/pieces
    for name in ${ABLATION_EXPORT//,/ }; do
      d=/tmp/q.ablation/$name
      python3 -m eagletrain export "$d/config.toml" --run-dir "$d" 2>&1 | grep -v "━" | tail -3
      pack_export "$d" "export-$name"
    done
    send_pieces
  fi ;;
trainbench)
  # bench/train_online.py on the run's data (a kept data stage: .carry/r): the target's
  # forward padded against packed, the decoder layer compiled, the TTT block masks
  timeout "${BENCH_S:-420}" python3 bench/train_online.py /tmp/q --set target.model="$M" \
    --variants "${VARIANTS:-padded,packed,packed+compile}" --steps "${STEPS:-30}" \
    --profile "${PROFILE_VARIANT:-packed}" --profile-out $OUT/train_online_profile.txt \
    2>&1 | grep -v -i "warn\|━\|Loading weights" | tee $OUT/train_online.log ;;
decode)
  # one process per engine (a failure or time limit in one leaves the rest); each builds
  # its engine once for every dataset and temperature and saves each result as it is done
  ENGINES="${ENGINES:-compiled,eager}"
  for engine in ${ENGINES//,/ }; do
    timeout "${DECODE_S:-240}" python3 bench/decode.py /tmp/q --model "$M" --engines $engine \
      --datasets "${DATASETS:-/tmp/c/question.jsonl,/tmp/c/HumanEval.jsonl.gz,heldout}" \
      --temperatures "${TEMPERATURES:-0,1}" --prompts "${PROMPTS:-3}" --max-new "${MAX_NEW:-128}" \
      2>&1 | grep -v -i "warn\|━" | tee -a $OUT/decode.log
  done
  tar -C /tmp/q/eval -czf $OUT/bench_json.tgz . ;;
prompts)
  # the data stage until its prompts sub-stage (data.source "self") is verified complete,
  # then a stop (resumable); the ledger, which holds every prompt written, comes back
  python3 -m eagletrain data $CFG --run-dir /tmp/q "${SETS[@]}" > /tmp/prompts_call.log 2>&1 &
  pid=$!
  until python3 -c 'import sqlite3,sys; c=sqlite3.connect("/tmp/q/ledger.sqlite"); sys.exit(0 if c.execute("SELECT 1 FROM completions WHERE stage=\x27prompts\x27").fetchone() else 1)' 2>/dev/null; do
    kill -0 $pid 2>/dev/null || break
    [ $SECONDS -gt "${PROMPTS_S:-100000}" ] && break  # a stop: the next call resumes
    sleep 5
  done
  kill -INT $pid 2>/dev/null; sleep "${DRAIN_S:-45}"; kill -INT $pid 2>/dev/null; wait $pid
  grep -v "━" /tmp/prompts_call.log | tail -3 | tee $OUT/prompts.log
  python3 -m eagletrain status /tmp/q | tee -a $OUT/prompts.log
  python3 -c 'import sqlite3; c=sqlite3.connect("/tmp/q/ledger.sqlite"); [print(repr(t)[:300]) for (t,) in c.execute("SELECT text FROM self_prompts WHERE dropped IS NULL AND slot % 5000 = 7 ORDER BY slot")]' | tee -a $OUT/prompts.log
  tar -C /tmp/q -czf - config.toml ledger.sqlite | split -b 15M - $OUT/prompts.tgz. ;;
regen)
  # completion tokens/s of each local decoder on the same first turns, beside the KV-read
  # limit (bench/regen_local.py); ROW_S: each configuration decodes at most this long, so
  # that a slow one leaves time for the rest (2026-12-07: a packed row took the call)
  timeout "${REGEN_S:-400}" python3 bench/regen_local.py --model "$M" --source /tmp/c/$DATA_FILE \
    --dtype bfloat16 --prompts "${REGEN_PROMPTS:-4096}" --max-tokens "${MAX_NEW:-256}" \
    ${REGEN_CONFIGS:+--configs $REGEN_CONFIGS} ${ROW_S:+--row-seconds $ROW_S} 2>&1 | grep -v -i "warn\|━" | tee $OUT/regen_bench.log ;;
engines)
  # decoding cost per step and cycle on each engine (random weights, SmolLM2's shape)
  # compiled first: the engine served, and the one a time limit must not cut (sixth part)
  timeout "${ENGINE_S:-240}" python3 bench/decode_engine.py --dtype bfloat16 --tokens 96 \
    --engines "${ENGINES:-compiled,static,eager}" ${ENGINE_PROFILE:+--profile $ENGINE_PROFILE} \
    2>&1 | grep -v -i "warn" | tee $OUT/decode_engine.log ;;
esac
exit 0
