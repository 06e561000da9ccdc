#!/usr/bin/env bash
# One GPU session's work, run on the GPU machine from the repository root (built by
# bench/gpu/prepare.sh): versions, the GPU tests, train_gpt on CUDA against the CPU on the default
# task, and GPT-2 124M training (bf16) against PyTorch eager and torch.compile on the same GPU.
# Every log goes to $OUT (the device tool brings it back); summary.txt has the figures.
set -uo pipefail
G=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/fz-out}; mkdir -p "$OUT"
S=$OUT/summary.txt
note() { echo "$*" | tee -a "$S"; }
# shellcheck disable=SC1091
source "$G/device_env.sh" > "$OUT/env.log" 2>&1
nvidia-smi >> "$OUT/env.log" 2>&1
export FERROZERO_KERNEL_CACHE=/tmp/fz-kernels RUST_BACKTRACE=1
export FERROZERO_PTXAS=${FERROZERO_PTXAS:-$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)}
"$G/ferrozero" report > "$OUT/report.log" 2>&1; grep -E "gpu|nvrtc|cuda" "$OUT/report.log" | tee -a "$S"

phase=${1:-all}
# Seconds per test binary, per training run, and for each side of the GPT-2 comparison; libtest
# filters for the test binaries (e.g. "::cuda_f32 ::cuda_bf16 real_" for the real-GPU cases only).
TEST_T=${TEST_T:-300} TRAIN_T=${TRAIN_T:-300} GPT2_T=${GPT2_T:-400}
read -r -a FILTER <<< "${TEST_FILTER:-}"
if [ "$phase" = all ] || [ "$phase" = tests ]; then
  for t in "$G"/tests/*; do
    n=$(basename "$t")
    timeout "$TEST_T" "$t" --test-threads 2 "${FILTER[@]}" > "$OUT/test_$n.log" 2>&1
    note "test $n: exit $? ($(grep -E '^test result' "$OUT/test_$n.log" | tail -1)); skipped lines: $(grep -c '^skipped' "$OUT/test_$n.log")"
    grep -E '^test .*FAILED|panicked' "$OUT/test_$n.log" | head -5 | tee -a "$S"
  done
fi
if [ "$phase" = all ] || [ "$phase" = train ]; then
  for dev in cuda cpu; do
    timeout "$TRAIN_T" "$G/train_gpt" --device $dev --ranks 1 --no-progress --metrics "$OUT/addition_$dev.jsonl" \
      > "$OUT/addition_$dev.log" 2>&1
    note "addition on $dev: exit $? $(grep -o 'heldout_loss=.*' "$OUT/addition_$dev.log")"
  done
fi
if [ "$phase" = all ] || [ "$phase" = gpt2 ]; then
  python3 -c "import random,struct; r=random.Random(0); open('/tmp/gpt2_tokens.bin','wb').write(struct.pack('<%dH'%(1<<22),*[r.randrange(50257) for _ in range(1<<22)]))"
  cat > /tmp/gpt2.json <<'JSON'
{"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
 "bf16": {"enabled": true}, "zero_optimization": {"stage": 0},
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}}
JSON
  timeout "$GPT2_T" "$G/train_gpt" --device cuda --ranks 1 --model-config gpt2-124m --config /tmp/gpt2.json \
    --data /tmp/gpt2_tokens.bin --seq-len 1024 --steps 25 --no-progress --bench-json \
    --metrics "$OUT/gpt2_ferrozero.jsonl" > "$OUT/gpt2_ferrozero.log" 2>&1
  note "ferrozero gpt2-124m: exit $? $(grep '^{' "$OUT/gpt2_ferrozero.log" | tail -1)"
  timeout "$GPT2_T" python3 "$G/gpt2_torch.py" --modes eager,compile --steps 25 > "$OUT/gpt2_torch.log" 2>&1
  note "torch: exit $?"; grep '^{' "$OUT/gpt2_torch.log" | tee -a "$S"
fi
base='"train_micro_batch_size_per_gpu": 16, "gradient_clipping": 1.0, "bf16": {"enabled": true},
 "optimizer": {"type": "AdamW", "params": {"lr": 6e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}}'
off='{"device": "cpu", "pin_memory": true}'
if [ "$phase" = all ] || [ "$phase" = stages ]; then
  # GPT-2 124M bf16 on the GPU at stage 0, stage 3 with the optimizer on the CPU (pinned,
  # overlapped), and stage 3 with parameters and optimizer on the CPU: same world size and
  # device, so every step's loss and gradient norm must be the same bits.
  [ -f /tmp/gpt2_tokens.bin ] || python3 -c "import random,struct; r=random.Random(0); open('/tmp/gpt2_tokens.bin','wb').write(struct.pack('<%dH'%(1<<22),*[r.randrange(50257) for _ in range(1<<22)]))"
  echo "{$base, \"zero_optimization\": {\"stage\": 0}}" > /tmp/s0.json
  echo "{$base, \"zero_optimization\": {\"stage\": 3, \"overlap_comm\": true, \"offload_optimizer\": $off}}" > /tmp/s3o.json
  echo "{$base, \"zero_optimization\": {\"stage\": 3, \"overlap_comm\": true, \"offload_optimizer\": $off, \"offload_param\": $off}}" > /tmp/s3op.json
  for c in s0 s3o s3op; do
    timeout "$TRAIN_T" "$G/train_gpt" --device cuda --ranks 1 --model-config gpt2-124m --config /tmp/$c.json \
      --data /tmp/gpt2_tokens.bin --seq-len 1024 --steps "${STAGE_STEPS:-12}" --no-progress --bench-json \
      --metrics "$OUT/stage_$c.jsonl" > "$OUT/stage_$c.log" 2>&1
    note "gpt2 $c: exit $? $(grep '^{' "$OUT/stage_$c.log" | tail -1)"
  done
  python3 - "$OUT" <<'PY' | tee -a "$S"
import json, sys
runs = {c: [json.loads(l) for l in open(f"{sys.argv[1]}/stage_{c}.jsonl")] for c in ("s0", "s3o", "s3op")}
key = lambda r: [(m["step"], m["loss"], m["grad_norm"]) for m in r]
for c in ("s3o", "s3op"):
    same = key(runs[c]) == key(runs["s0"]) and len(runs[c]) > 0
    print(f"stages: {c} vs s0 over {len(runs[c])} steps: {'bitwise identical' if same else 'DIFFERENT'}")
    if not same:
        for a, b in zip(key(runs["s0"]), key(runs[c])):
            print("  s0", a, c, b)
PY
fi
if [ "$phase" = all ] || [ "$phase" = breakdown ]; then
  # Where a GPT-2 124M step goes at stage 3 on the GPU, with and without the optimizer on the
  # CPU (per-phase wall clock, the last steps), and the host optimizer alone at 16 and 8 threads.
  [ -f /tmp/gpt2_tokens.bin ] || python3 -c "import random,struct; r=random.Random(0); open('/tmp/gpt2_tokens.bin','wb').write(struct.pack('<%dH'%(1<<22),*[r.randrange(50257) for _ in range(1<<22)]))"
  for t in ${ADAM_THREADS-16 8}; do
    "$G/ferrozero" bench adam --params 124439808 --dtype bf16 --threads $t --steps 5 --json 2>&1 | tail -1 | tee -a "$S"
  done
  wc='"wall_clock_breakdown": true, "steps_per_print": 1'
  echo "{$base, $wc, \"zero_optimization\": {\"stage\": 0}}" > /tmp/b0.json
  echo "{$base, $wc, \"zero_optimization\": {\"stage\": 3, \"overlap_comm\": false}}" > /tmp/b3n.json
  echo "{$base, $wc, \"zero_optimization\": {\"stage\": 3, \"overlap_comm\": true}}" > /tmp/b3.json
  echo "{$base, $wc, \"zero_optimization\": {\"stage\": 3, \"overlap_comm\": true, \"offload_optimizer\": $off}}" > /tmp/b3o.json
  for run in ${BREAKDOWN_RUNS:-b0:16 b3n:16 b3:16 b3o:16 b3o:4}; do
    c=${run%:*} t=${run#*:}
    RAYON_NUM_THREADS=$t timeout "$TRAIN_T" "$G/train_gpt" --device cuda --ranks 1 --model-config gpt2-124m \
      --config /tmp/$c.json --data /tmp/gpt2_tokens.bin --seq-len 1024 --steps 8 --no-progress \
      > "$OUT/breakdown_${c}_$t.log" 2>&1
    note "breakdown $c, $t threads: exit $?"
    grep "time (ms)" "$OUT/breakdown_${c}_$t.log" | tail -3 | sed 's/.*step/  step/' | tee -a "$S"
    grep -o "trained .*" "$OUT/breakdown_${c}_$t.log" | sed 's/^/  /' | tee -a "$S"
  done
fi
