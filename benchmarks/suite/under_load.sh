#!/usr/bin/env bash
# `make test`, N times in a row (default 5), each while a second full suite runs beside it on the
# same cores: the suite must stay green when the machine is busy (issue 26). Run from the repo root
# after `make setup`. Prints one line per run; logs go to $OUT (default benchmarks/out/suite).
set -u
N=${1:-5}
OUT=${OUT:-benchmarks/out/suite}
mkdir -p "$OUT"
for i in $(seq 1 "$N"); do
  .venv/bin/python -m pytest -q -n 3 --dist worksteal -p no:cacheprovider > "$OUT/beside-$i.txt" 2>&1 &
  beside=$!
  start=$(date +%s)
  make test > "$OUT/run-$i.txt" 2>&1
  rc=$?
  wall=$(( $(date +%s) - start ))
  wait $beside
  echo "run $i: make test rc=$rc in ${wall}s: $(tail -n 1 "$OUT/run-$i.txt") | beside: $(tail -n 1 "$OUT/beside-$i.txt")"
done
