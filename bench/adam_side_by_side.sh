#!/usr/bin/env bash
# CPU AdamW step throughput, ours against DeepSpeedCPUAdam, torch fused AdamW and the C AdamW
# roofline loop (28 bytes per parameter; `../shared/bench/stream_triad.c`), interleaved in one
# go because the machine is shared and noisy. Prints medians of RUNS runs and ratios.
#
# Needs the baseline venv (`../shared/bench/setup_venv.sh`, VENV=/tmp/basevenv) and a release
# build of the CLI. Usage: bench/adam_side_by_side.sh   Env: RUNS=3 VENV=/tmp/basevenv
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}; VENV=${VENV:-/tmp/basevenv}; SHARED=${SHARED:-../shared/bench}
export PATH="$VENV/bin:$PATH"   # ninja, for the JIT-built cpu_adam op
out=$(mktemp); trap 'rm -f "$out" /tmp/fz-stream-triad' EXIT
cargo build --release --bin ferrozero >&2
gcc -O3 -march=native -fopenmp -fno-math-errno "$SHARED/stream_triad.c" -o /tmp/fz-stream-triad -lm
for run in $(seq 1 "$RUNS"); do
  for n in 10000000 100000000; do
    for t in 1 2; do
      target/release/ferrozero bench adam --params $n --threads $t --json 2>/dev/null \
        | grep '^{' | sed "s/^{/{\"impl\":\"ferrozero\",/" >> "$out"
      for impl in ds_cpu_adam torch_fused; do
        OMP_NUM_THREADS=$t "$VENV/bin/python" "$SHARED/optim_step.py" --impl $impl --n $n --threads $t 2>/dev/null \
          | grep '^{' >> "$out" || true
      done
      OMP_NUM_THREADS=$t OMP_PROC_BIND=spread /tmp/fz-stream-triad $n 5 | grep adamw_fp32_c \
        | sed "s/^{/{\"impl\":\"c_roofline\",/" >> "$out"
    done
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys, collections
rows = collections.defaultdict(list)
for line in open(sys.argv[1]):
    try: d = json.loads(line)
    except ValueError: continue
    impl = d.get("impl")
    n = d.get("params") or d.get("n")
    t = d.get("threads")
    v = d.get("params_per_s") or d.get("best_params_per_s")
    if impl and n and t and v: rows[(int(n), int(t), impl)].append(float(v))
med = {k: statistics.median(v) for k, v in rows.items()}
print("| params | threads | ferrozero | DeepSpeedCPUAdam | torch fused | C roofline loop | vs DS | vs roofline |")
print("|---|---|---|---|---|---|---|---|")
for n in (10_000_000, 100_000_000):
    for t in (1, 2):
        g = lambda i: med.get((n, t, i), float("nan"))
        ours, ds, tf, c = g("ferrozero"), g("ds_cpu_adam"), g("torch_fused"), g("c_roofline")
        print(f"| {n/1e6:.0f}M | {t} | {ours/1e9:.2f}G | {ds/1e9:.2f}G | {tf/1e9:.2f}G | {c/1e9:.2f}G | {ours/ds:.2f}x | {ours/c:.0%} |")
PY
