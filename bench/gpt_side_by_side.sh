#!/usr/bin/env bash
# ferrozero vs PyTorch DDP and DeepSpeed ZeRO 1-3 on the same GPT shape (6 layers, d_model 384,
# 6 heads, vocab 4096, seq 128, micro-batch 8 per rank, 2 ranks, 20 steps, first 2 excluded),
# back to back in one sitting, so the ratios hold on a noisy machine.
# Needs the baseline venv: bash ../shared/bench/setup_venv.sh (see ../shared/bench/README.md).
# Usage: bash bench/gpt_side_by_side.sh [baseline configs...]   (default: ddp z1 z2 z3 z1off z2off z3off)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-/tmp/fz-bench}
[ -d "$BASE" ] || cp -r ../shared/bench "$BASE"
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
cargo build --release --example train_gpt
python3 - <<'PY'
import random, struct
random.seed(0)
with open("/tmp/fz-gpt-tokens.bin", "wb") as f:
    f.write(struct.pack("<%dH" % (1 << 20), *[random.randrange(4096) for _ in range(1 << 20)]))
PY
for s in 0 1 2 3 1off 2off 3off; do
  stage=${s%off}
  cfg=/tmp/fz-gpt-z$s.toml
  printf 'train_micro_batch_size_per_gpu = 8\ngradient_clipping = 1.0\n[zero_optimization]\nstage = %s\noverlap_comm = true\n[optimizer]\ntype = "AdamW"\nparams = { lr = 3e-4, betas = [0.9, 0.95], weight_decay = 0.1 }\n' "$stage" > "$cfg"
  [ "$s" != "$stage" ] && printf '[zero_optimization.offload_optimizer]\ndevice = "cpu"\n' >> "$cfg"
  RAYON_NUM_THREADS=2 ./target/release/examples/train_gpt --config "$cfg" --ranks 2 --model-config bench-15m \
    --data /tmp/fz-gpt-tokens.bin --seq-len 128 --steps 20 --no-progress --bench-json 2>/dev/null \
    | grep '^{' | sed "s/}\$/, \"config\": \"z$s\"}/" | tee -a "$OUT/ferrozero_gpt.jsonl"
done
RUNS=${RUNS:-1} bash "$BASE/run_gpt.sh" ${*:-ddp z1 z2 z3 z1off z2off z3off} | tee -a "$OUT/baseline_gpt.jsonl"
