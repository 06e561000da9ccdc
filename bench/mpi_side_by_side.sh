#!/usr/bin/env bash
# ferrozero's MPI communicator next to Open MPI called directly, in one run:
# bench/mpi_baseline.c (MPI_Allreduce / MPI_Reduce_scatter_block / MPI_Allgather) and
# `ferrozero bench comm --backend mpi --json` in native and rank-ordered mode, both measuring
# the same way (see mpi_baseline.c), alternated ROUNDS times per process count so a noisy
# machine hits every side alike. Prints, per process count, op and size, the median bus
# bandwidth of each side and the ratios baseline/ferrozero (1.00 = as fast as Open MPI; the
# goal is at most 1.2), plus the load before and after.
# Usage: bash bench/mpi_side_by_side.sh [path/to/ferrozero built with --features mpi]
# Env: ROUNDS=3 NPROCS="2 4" MIN=1M MAX=256M OPS=all_reduce,reduce_scatter,all_gather
#      OUT=dir to keep the raw JSON lines
set -euo pipefail
cd "$(dirname "$0")/.."
FZ=${1:-target/release/ferrozero}
ROUNDS=${ROUNDS:-3}
NPROCS=${NPROCS:-2 4}
MIN=${MIN:-1M}; MAX=${MAX:-256M}
OPS=${OPS:-all_reduce,reduce_scatter,all_gather}
W=${OUT:-$(mktemp -d)}; mkdir -p "$W"
bytes() { python3 -c "import sys;s=sys.argv[1];m={'K':1<<10,'M':1<<20,'G':1<<30};print(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s))" "$1"; }
"$FZ" bench comm --backend mpi --max-bytes 4K --min-bytes 4K --json >/dev/null 2>&1 </dev/null || {
  echo "$FZ cannot run the MPI backend (build it with: cargo build --release --features mpi)"; exit 2; }
mpicc -O2 bench/mpi_baseline.c -o "$W/mpi_baseline"
ROOT=(); [ "$(id -u)" -eq 0 ] && ROOT=(--allow-run-as-root)
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg); cores: $(nproc); $(mpirun --version | head -1)"
for n in $NPROCS; do
  MPI=(mpirun "${ROOT[@]}" --oversubscribe -n "$n")
  for r in $(seq "$ROUNDS"); do
    "${MPI[@]}" "$W/mpi_baseline" "$(bytes "$MIN")" "$(bytes "$MAX")" | sed "s/^{/{\"side\":\"openmpi\",\"round\":$r,/" >> "$W/rows.jsonl"
    for red in native rank-ordered; do
      "${MPI[@]}" "$FZ" bench comm --backend mpi --json --reduction "$red" --ops "${OPS//_/-}" \
        --min-bytes "$MIN" --max-bytes "$MAX" | sed "s/^{/{\"side\":\"ferrozero-$red\",\"round\":$r,/" >> "$W/rows.jsonl"
    done
    echo "n=$n round $r done; load $(cut -d' ' -f1-3 /proc/loadavg)"
  done
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$W/rows.jsonl" "$OPS" <<'PY'
import json, statistics, sys, collections
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
ops = sys.argv[2].split(",")
bw = collections.defaultdict(list)
for r in rows:
    bw[(r["ranks"], r["op"], r["bytes"], r["side"])].append(r["busbw_gbps"])
med = {k: statistics.median(v) for k, v in bw.items()}
print(f"{'n':>2} {'op':>15} {'MiB':>6} {'openmpi':>8} {'fz-nat':>8} {'fz-ord':>8} {'ratio nat':>10} {'ratio ord':>10}   (busbw GB/s, medians; ratio = Open MPI / ferrozero)")
worst = collections.defaultdict(float)
for (n, op, b) in sorted({k[:3] for k in med}, key=lambda k: (k[0], ops.index(k[1]) if k[1] in ops else 9, k[2])):
    base = med.get((n, op, b, "openmpi"))
    nat = med.get((n, op, b, "ferrozero-native"))
    ordd = med.get((n, op, b, "ferrozero-rank-ordered"))
    if not (base and nat and ordd):
        continue
    rn, ro = base / nat, base / ordd
    worst["native"] = max(worst["native"], rn); worst["rank-ordered"] = max(worst["rank-ordered"], ro)
    print(f"{n:>2} {op:>15} {b/2**20:>6.0f} {base:>8.3f} {nat:>8.3f} {ordd:>8.3f} {rn:>10.2f} {ro:>10.2f}")
print("worst ratio: " + ", ".join(f"{k} {v:.2f}" for k, v in worst.items()))
PY
echo "raw rows: $W/rows.jsonl"
