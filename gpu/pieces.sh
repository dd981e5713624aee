#!/usr/bin/env bash
# Builds, on this machine, the pieces gpu/session.sh carries to the H200 (64 MiB a
# call, ../shared/reference/GPU.md), from the packages scripts/install.sh installed:
#   .carry/a  the SmolLM2 GGUF's first 38,000,000 bytes
#   .carry/b  the rest of it, and wheels for what the H200's image lacks (cp312)
#   .carry/c  evaluation prompts: MT-bench question.jsonl, HumanEval.jsonl.gz
#   .carry/d  sharegpt_all.jsonl.gz: every parseable record of the packaged ShareGPT file
#             (17,671; the file ends mid-record), one JSON object a line
#   .carry/r, .carry/e, .carry/s, .carry/t  an earlier session's run pieces, where
#             gpu/kept.txt names the commit that kept them (gpu/keep.sh)
# .carry/ is ignored by git (.gitignore). Run from the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
rm -rf .carry/a .carry/b .carry/c .carry/d
mkdir -p .carry/a .carry/b .carry/c .carry/d
embedded() { $PY -c "from eagletrain.embedded import embedded_file; print(embedded_file('$1'))"; }
G=$(embedded smollm2)
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c
head -c 38000000 "$G" > .carry/a/gguf.part.aa
tail -c +38000001 "$G" > .carry/b/gguf.part.ab
# pure-Python wheels and pydantic-core for the H200's Python 3.12 (versions as installed here)
pins=$($PY -m pip freeze | grep -i -E '^(gguf|pydantic|pydantic.core|typing.inspection|annotated.types|tomli.w|datasketch)==')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .carry/b $pins
cp "$(embedded mtbench)" .carry/c/question.jsonl
cp "$(embedded humaneval)" .carry/c/HumanEval.jsonl.gz
$PY - <<'PY'
import gzip
import json

from eagletrain.data.conversations import _parsed_objects, source_path

records = [obj for _where, obj, error in _parsed_objects(source_path("sharegpt")) if error is None]
lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
with gzip.open(".carry/d/sharegpt_all.jsonl.gz", "wt", encoding="utf-8", compresslevel=9) as f:
    f.write(lines)
print(f"sharegpt_all.jsonl.gz: {len(records)} records")
PY
# pieces an earlier session kept (gpu/keep.sh): into .carry/r, .carry/e unless there
[ -f gpu/kept.txt ] && while read -r kind sha note; do
  if ls .carry/"$kind"/* >/dev/null 2>&1; then continue; fi
  mkdir -p .carry/"$kind"
  for f in $(git ls-tree -r --name-only "$sha" "kept/$kind"); do
    git show "$sha:$f" > ".carry/$kind/$(basename "$f")"
  done
  echo "restored .carry/$kind from $sha: $note"
done < gpu/kept.txt
du -sh .carry/*
