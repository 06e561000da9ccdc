#!/usr/bin/env bash
# ferrozero's NVMe store (`ferrozero bench swap`) against fio on the same disk, side by side:
# sequential BS requests, O_DIRECT, io_uring, the same queue depths and file size, read and
# write. The disk is shared and noisy, so each run alternates who goes first (odd runs: ours
# first; even runs: fio first), every figure is a median over RUNS runs, and the table gives
# ours/fio ratios. Both sides run the same sequence: a new file (our store creates one per
# run; on this virtual disk fio moved half as fast over a file laid out an hour earlier as
# over a new one), an untimed write and read of it, then LOOPS rounds of one write pass and
# one read pass, each figure the median over the rounds.
# Usage: bash bench/swap_vs_fio.sh
# Env: DIR=/var/tmp/fz-swap-vs-fio (must be on the disk to measure; /tmp may be a tmpfs)
#      SIZE_MIB=2048 QDS="8 32" BS_KIB=1024 RUNS=3 LOOPS=3 OUT=bench/results/swap_vs_fio.jsonl
#      BIN=target/release/ferrozero (set NO_BUILD=1 to use it as it is)
#      FIO_MEM=malloc: fio's buffers. Over scattered 4 KiB pages a 1 MiB request splits at the
#      device's segment limit; our store's buffers ask for transparent huge pages. For fio to
#      match, reserve huge pages and use FIO_MEM=shmhuge:
#        echo 40 > /proc/sys/vm/nr_hugepages; FIO_MEM=shmhuge bash bench/swap_vs_fio.sh
# Needs: fio (apt-get install -y fio), python3.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${DIR:-/var/tmp/fz-swap-vs-fio}; SIZE_MIB=${SIZE_MIB:-2048}; QDS=${QDS:-"8 32"}
BS_KIB=${BS_KIB:-1024}; RUNS=${RUNS:-3}; LOOPS=${LOOPS:-3}
OUT=${OUT:-bench/results/swap_vs_fio.jsonl}; BIN=${BIN:-target/release/ferrozero}
FIO_MEM=${FIO_MEM:-malloc}
command -v fio >/dev/null || { echo "swap_vs_fio: needs fio (apt-get install -y fio)" >&2; exit 2; }
[ -n "${NO_BUILD:-}" ] || cargo build --release --bin ferrozero
mkdir -p "$DIR" "$(dirname "$OUT")"
: > "$OUT.tmp"
F="$DIR/fio-swap-vs-fio.dat"
BYTES=$((SIZE_MIB << 20))
echo "# disk: $(df -h --output=source,fstype,size,avail "$DIR" | tail -1)  file: $SIZE_MIB MiB  bs: $BS_KIB KiB  fio mem: $FIO_MEM" >&2

ours() { # run qd
  "$BIN" bench swap --path "$DIR" --bytes "$BYTES" --block-size $((BS_KIB << 10)) --queue-depth "$2" \
    --engine io-uring --loops "$LOOPS" --json \
  | python3 -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(json.dumps(dict(tool="ferrozero", op=r["op"], qd=int(sys.argv[2]), run=int(sys.argv[1]),
                          gbps=r["gbps"], engine=r["engine"], direct=r["direct"])))' "$1" "$2"
}

fio_pass() { # qd rw: one timed pass over the file, GB/s
  fio --name=seq --filename="$F" --size="${SIZE_MIB}M" --bs="${BS_KIB}k" --direct=1 --ioengine=io_uring \
      --iodepth="$1" --rw="$2" --mem="$FIO_MEM" --output-format=json \
  | python3 -c 'import json, sys; print(json.load(sys.stdin)["jobs"][0][sys.argv[1]]["bw_bytes"] / 1e9)' "$2"
}

theirs() { # run qd: the same sequence as `bench swap`: a new file, an untimed write and read
  # (layout), then LOOPS rounds of one write pass and one read pass; medians over the rounds.
  rm -f "$F"
  fio_pass "$2" write >/dev/null; fio_pass "$2" read >/dev/null
  local w=() r=()
  for _ in $(seq 1 "$LOOPS"); do w+=("$(fio_pass "$2" write)"); r+=("$(fio_pass "$2" read)"); done
  rm -f "$F"
  python3 -c '
import json, statistics, sys
run, qd, loops = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
v = [float(x) for x in sys.argv[4:]]
for op, xs in (("write", v[:loops]), ("read", v[loops:])):
    print(json.dumps(dict(tool="fio", op=op, qd=qd, run=run, gbps=statistics.median(xs),
                          engine="io_uring", direct=True)))' "$1" "$2" "$LOOPS" "${w[@]}" "${r[@]}"
}

for run in $(seq 1 "$RUNS"); do
  for qd in $QDS; do
    if [ $((run % 2)) -eq 1 ]; then ours "$run" "$qd"; theirs "$run" "$qd"; else theirs "$run" "$qd"; ours "$run" "$qd"; fi
  done | tee -a "$OUT.tmp" >&2
done
cat "$OUT.tmp" >> "$OUT"
python3 - "$OUT.tmp" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = sorted({(r["op"], r["qd"]) for r in rows}, key=lambda k: (k[0] != "read", k[1]))
print(f"| op    | QD | ferrozero GB/s (runs)         | fio GB/s (runs)               | ratio |")
print(f"|-------|----|-------------------------------|-------------------------------|-------|")
for op, qd in keys:
    def pick(tool):
        return [r["gbps"] for r in rows if (r["tool"], r["op"], r["qd"]) == (tool, op, qd)]
    ours, fio = pick("ferrozero"), pick("fio")
    mo, mf = statistics.median(ours), statistics.median(fio)
    runs = lambda v: " ".join(f"{x:.2f}" for x in v)
    print(f"| {op:5} | {qd:2} | {mo:5.2f} ({runs(ours):22}) | {mf:5.2f} ({runs(fio):22}) | {mo / mf:4.0%} |")
PY
rm -f "$OUT.tmp"
