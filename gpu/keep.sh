#!/usr/bin/env bash
# Keeps pieces a device call brought back (a run's rundata.tgz.*, export_sglang.tgz.*) for
# a later session. Ignored files do not outlive this checkout, and tracked ones travel with
# every device call (64 MiB in all, ../.library/device/README.md), so the pieces go into
# one commit under kept/KIND/ and out of the tree in the next; gpu/kept.txt names
# the first, and gpu/pieces.sh restores .carry/KIND from it. KIND is the carry
# folder gpu/session.sh reads them from: r (rundata), e (export_sglang), s (the scale run's
# ledger and config once its prompts were written: prompts.tgz), t (the scale run's data
# stage part-way: rundata.tgz, unpacked like r).
#   bash gpu/keep.sh r "data stage done, 15,704 conversations" /path/rundata.tgz.*
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: bash gpu/keep.sh r|e|s|t NOTE FILE..." >&2; exit 2; }
kind=$1 note=$2
shift 2
case $kind in r | e | s | t) ;; *) echo "keep.sh: KIND must be r, e, s or t, not $kind" >&2; exit 2 ;; esac
files=()
for f in "$@"; do files+=("$(realpath "$f")"); done
cd "$(dirname "$0")/.."
[ -z "$(git status --porcelain)" ] || { echo "keep.sh: commit your changes first" >&2; exit 2; }
mkdir -p "kept/$kind"
cp "${files[@]}" "kept/$kind/"
git add "kept/$kind"
git commit -q -m "keep: .carry/$kind pieces, $note (out of the tree again in the next commit)"
sha=$(git rev-parse HEAD)
git rm -q -r "kept/$kind"
touch gpu/kept.txt
{ grep -v "^$kind " gpu/kept.txt || true; echo "$kind $sha $note"; } > gpu/kept.txt.new
mv gpu/kept.txt.new gpu/kept.txt
git add gpu/kept.txt
git commit -q -m "keep: .carry/$kind pieces kept in $(git rev-parse --short "$sha"), out of the tree"
echo "kept in $sha: $(git ls-tree -r --name-only "$sha" "kept/$kind" | tr '\n' ' ')"
