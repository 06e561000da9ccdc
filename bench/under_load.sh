#!/usr/bin/env bash
# Runs a command while busy loops keep every core busy (a "loaded machine": many builds on a few shared cores), and
# stops the loops afterwards. Prints the load average before and after.
# Usage: bash bench/under_load.sh [-n COUNT] -- command args...
#   -n COUNT  run the command COUNT times in a row, stopping at the first failure
# Env: LOAD_PROCS (default: nproc) busy loops.
set -uo pipefail
count=1
if [ "${1:-}" = "-n" ]; then count=$2; shift 2; fi
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "usage: $0 [-n COUNT] -- command..." >&2; exit 2; }
pids=()
stop() { [ ${#pids[@]} -gt 0 ] && kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; }
trap stop EXIT
for _ in $(seq "${LOAD_PROCS:-$(nproc)}"); do
  ( while :; do :; done ) &
  pids+=($!)
done
echo "load: ${#pids[@]} busy loops (pids ${pids[*]}); loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq "$count"); do
  if ! "$@"; then
    echo "FAILED on run $i of $count; loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
    exit 1
  fi
  echo "run $i of $count passed; loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
done
echo "all $count runs passed under load; loadavg $(cut -d' ' -f1-3 /proc/loadavg)"
