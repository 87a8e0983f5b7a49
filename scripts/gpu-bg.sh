#!/usr/bin/env bash
# Long GPU runs across several device calls (each call is limited to 10 minutes, and the machine
# stays warm between back-to-back calls). Runs `scripts/gpu-run.sh MODE ARGS` in the background,
# in its own snapshot of the working tree (later calls replace the tree) and its own session (so it
# outlives the call), on the GPUs named:
#
#   bash scripts/gpu-bg.sh start NAME GPUS MODE [ARGS]   # e.g. start tests 0,1,2 tests
#   bash scripts/gpu-bg.sh start score 0 bench-score      # the scoring figures' run (gpu-run.sh's default)
#   AFTER=sync bash scripts/gpu-bg.sh start tests 0,1,2 tests   # queued behind job "sync"
#   AFTER="a b" bash scripts/gpu-bg.sh start op 0,1,2,3 tests ...  # queued behind jobs "a" and "b"
#   bash scripts/gpu-bg.sh wait SECONDS [NAME ...]        # wait (bounded) for jobs; logs to $OUT
#   bash scripts/gpu-bg.sh status                         # tails of every job's log; the archive in $OUT
#
# Logs and results live in /tmp/rp-bg/NAME/ (log, rc, and whatever the run wrote to its OUT); wait
# and status put every job's log, rc and result JSON/TXT in one archive, $OUT/rp-bg.tar.gz.
set -euo pipefail
cd "$(dirname "$0")/.."
BG=/tmp/rp-bg
OUT=${OUT:-/tmp/rewardplane-out}; mkdir -p "$OUT" "$BG"

collect() {
  # One archive of every job's log and result files: the device brings back a limited number of
  # files, and a few jobs' logs and JSONs already exceed it.
  (cd "$BG" && find . -mindepth 2 -maxdepth 3 -type f \( -path './*/log' -o -path './*/rc' \
      -o -path './*/out/*.json' -o -path './*/out/*.txt' \) -print0 \
    | tar --null -czf "$OUT/rp-bg.tar.gz" -T -) 2>/dev/null || true
  for d in "$BG"/*/; do
    [ -d "$d" ] || continue
    n=$(basename "$d")
    echo "== $n: $( [ -f "$d/rc" ] && echo "exit $(cat "$d/rc")" || echo running )"
    tail -n "${TAIL:-15}" "$d/log" 2>/dev/null || true
  done
}

case "${1:-}" in
  start)
    name=$2 gpus=$3; shift 3
    d=$BG/$name
    rm -rf "$d" && mkdir -p "$d/out"
    snap=$d/tree
    mkdir -p "$snap"
    # the tree without the carried wheels (they are installed already)
    tar --exclude=./.whl -cf - . | tar -xf - -C "$snap"
    # AFTER="NAME ...": start only once every job named has finished (jobs sharing GPUs, one call)
    after=""
    for a in ${AFTER:-}; do after="$after $BG/$a/rc"; done
    (cd "$snap" && CUDA_VISIBLE_DEVICES=$gpus OUT=$d/out AFTER_RC=$after setsid nohup bash -c \
      'for rc in $AFTER_RC; do while [ ! -f "$rc" ]; do sleep 2; done; done
       bash scripts/gpu-run.sh "$@"; echo $? > '"$d"'/rc' _ "$@" > "$d/log" 2>&1 < /dev/null &)
    echo "started $name on GPUs $gpus${AFTER:+ after $AFTER}: $*" ;;
  wait)
    secs=$2; shift 2
    names=("$@")
    [ ${#names[@]} -gt 0 ] || names=($(ls "$BG"))
    end=$((SECONDS + secs))
    while [ $SECONDS -lt $end ]; do
      left=0
      for n in "${names[@]}"; do [ -f "$BG/$n/rc" ] || left=1; done
      [ $left -eq 0 ] && break
      sleep 5
    done
    collect ;;
  status) collect ;;
  *) echo "usage: gpu-bg.sh start NAME GPUS MODE [ARGS] | wait SECONDS [NAME...] | status"; exit 2 ;;
esac
