#!/usr/bin/env bash
# The loop, team and restore benchmarks for two revisions of this repository in the same run:
#
#     benchmarks/suite/before_after.sh REV [REV2]        # REV2 defaults to HEAD
#     ROUNDS=5 OUT=/tmp/ba benchmarks/suite/before_after.sh main house-bench
#
# A = REV, B = REV2, each checked out in its own temporary worktree (git worktree add --detach)
# with its native module built from that revision's own sources (pip install --target, one build
# per distinct native tree: revisions with the same native/, CMakeLists.txt and pyproject.toml
# share it) and copied into the worktree's ucpd/. Every run uses this checkout's .venv python
# (PYTHON to change) with PYTHONPATH=<worktree>:<worktree>/client and the editable install's
# import redirect turned off (SKBUILD_EDITABLE_SKIP), so each revision runs its own code, native
# included; the line "A: ucpd from ..." before each run says which files it imported.
#
# Rounds (ROUNDS, default 3) alternate A, B, A, B, ...: each round runs loop, team and restore for
# A, then the same for B, so both see the same machine. The flags are the benchmarks' documented
# small ones, not their defaults (those take 3 to 8 minutes each here), so that 3 rounds finish in
# about 10 minutes on a quiet 2-core machine (20 beside two test suites):
#   loop:    bench_loop.py --quick --skip-train         (256 MiB, 4 warm snapshots idle, 11 with flushes)
#   team:    bench_team.py --only replication,recovery,latency --size-mib 64 --recovery-mib 32
#            --steps 3 --reps 2 --latency-nodes 2 --latency-steps 5
#   restore: bench_snapshot.py --restore-only --size-gib 0.25 --reps 3
# (LOOP_ARGS, TEAM_ARGS, RESTORE_ARGS replace them.) Each run's output and JSON go to $OUT
# (default: a new folder under /tmp); last, a table per metric: median [min - max] over the
# rounds for A and for B, and B/A of the medians (above 1: B is slower or smaller, read the
# metric's name). The machine is shared and noisy: read the spread before a ratio.
set -euo pipefail

REV_A=${1:?usage: before_after.sh REV [REV2]}
REV_B=${2:-HEAD}
ROUNDS=${ROUNDS:-3}
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
LOOP_ARGS=${LOOP_ARGS:---quick --skip-train}
TEAM_ARGS=${TEAM_ARGS:---only replication,recovery,latency --size-mib 64 --recovery-mib 32 --steps 3 --reps 2 --latency-nodes 2 --latency-steps 5}
RESTORE_ARGS=${RESTORE_ARGS:---restore-only --size-gib 0.25 --reps 3}
OUT=${OUT:-$(mktemp -d /tmp/ucpd-before-after-XXXXXX)}
mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/ucpd-before-after-trees-XXXXXX)

SHA_A=$(git -C "$REPO" rev-parse --verify "$REV_A^{commit}")
SHA_B=$(git -C "$REPO" rev-parse --verify "$REV_B^{commit}")

cleanup() {
  for side in A B; do
    [ -d "$WORK/$side" ] && git -C "$REPO" worktree remove --force "$WORK/$side" >/dev/null 2>&1
  done
  rm -rf "$WORK"
  git -C "$REPO" worktree prune
}
trap cleanup EXIT

# the editable install's import redirect (a meta path finder that sends `import ucpd` to the
# checkout the venv was made in) steps aside for the build folder named in SKBUILD_EDITABLE_SKIP
SKIP=$("$PYTHON" -c "import sys; print(next((f.path for f in sys.meta_path if type(f).__name__ == 'ScikitBuildRedirectingFinder' and f.path), ''))")

native_key() {  # the trees the native module is built from, at a commit
  git -C "$REPO" rev-parse "$1:native" "$1:CMakeLists.txt" "$1:pyproject.toml" | tr '\n' '-'
}

declare -A BUILT  # native key -> the built module
for side in A B; do
  sha=$SHA_A; [ "$side" = B ] && sha=$SHA_B
  tree="$WORK/$side"
  git -C "$REPO" worktree add --detach "$tree" "$sha" >/dev/null 2>&1
  key=$(native_key "$sha")
  if [ -z "${BUILT[$key]:-}" ]; then
    echo "[$(date +%T)] $side ($sha): building the native module"
    "$PYTHON" -m pip install -q --no-build-isolation --no-deps --no-index --target "$WORK/site-$side" "$tree" > "$OUT/build-$side.txt" 2>&1 \
      || { echo "the native build of $REV_A/$REV_B failed: $OUT/build-$side.txt" >&2; tail -20 "$OUT/build-$side.txt" >&2; exit 1; }
    BUILT[$key]=$(ls "$WORK/site-$side"/ucpd/_native*.so)
  else
    echo "[$(date +%T)] $side ($sha): the same native sources as built before"
  fi
  cp "${BUILT[$key]}" "$tree/ucpd/"
done

run() {  # side name script args...
  local side=$1 name=$2 script=$3; shift 3
  local tree="$WORK/$side" log="$OUT/$name-$side-$round.txt"
  local env=(env "SKBUILD_EDITABLE_SKIP=$SKIP" "PYTHONPATH=$tree:$tree/client")
  local where
  where=$(cd "$tree" && "${env[@]}" "$PYTHON" -c "import ucpd, ucpd._native, ucpd_client; print(ucpd.__file__, ucpd._native.__file__, ucpd_client.__file__)")
  echo "[$(date +%T)] round $round, $name, $side: ucpd from $where"
  case "$where" in "$tree/"*" $tree/"*" $tree/"*) ;; *) echo "$side does not run its own code: $where" >&2; exit 1 ;; esac
  local start=$SECONDS
  if ! (cd "$tree" && "${env[@]}" "$PYTHON" "benchmarks/$script" "$@" --json "$OUT/$name-$side-$round.json") > "$log" 2>&1; then
    echo "  failed: $log" >&2
    tail -20 "$log" >&2
    exit 1
  fi
  echo "  $(( SECONDS - start )) s, load $(cut -d' ' -f1 /proc/loadavg)"
}

echo "A = $REV_A ($SHA_A), B = $REV_B ($SHA_B); $ROUNDS rounds; output in $OUT"
for round in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    # shellcheck disable=SC2086  # the ARGS are word lists
    run $side loop loop/bench_loop.py $LOOP_ARGS
    # shellcheck disable=SC2086
    run $side team team/bench_team.py $TEAM_ARGS
    # shellcheck disable=SC2086
    run $side restore snapshot/bench_snapshot.py $RESTORE_ARGS
  done
done

echo
echo "A = $REV_A ($SHA_A), B = $REV_B ($SHA_B), $ROUNDS rounds, $(nproc) CPUs, load at the end $(cut -d' ' -f1-3 /proc/loadavg)"
"$PYTHON" "$REPO/benchmarks/suite/before_after_table.py" "$OUT"
