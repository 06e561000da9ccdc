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
if [ "$phase" = all ] || [ "$phase" = tests ]; then
  for t in "$G"/tests/*; do
    n=$(basename "$t")
    timeout 300 "$t" --test-threads 2 > "$OUT/test_$n.log" 2>&1
    note "test $n: exit $? ($(grep -E '^test result' "$OUT/test_$n.log" | tail -1))"
  done
fi
if [ "$phase" = all ] || [ "$phase" = train ]; then
  for dev in cuda cpu; do
    timeout 300 "$G/train_gpt" --device $dev --ranks 1 --no-progress --metrics "$OUT/addition_$dev.jsonl" \
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
  timeout 400 "$G/train_gpt" --device cuda --ranks 1 --model-config gpt2-124m --config /tmp/gpt2.json \
    --data /tmp/gpt2_tokens.bin --seq-len 1024 --steps 25 --no-progress --bench-json \
    --metrics "$OUT/gpt2_ferrozero.jsonl" > "$OUT/gpt2_ferrozero.log" 2>&1
  note "ferrozero gpt2-124m: exit $? $(grep '^{' "$OUT/gpt2_ferrozero.log" | tail -1)"
  timeout 400 python3 "$G/gpt2_torch.py" --modes eager,compile --steps 25 > "$OUT/gpt2_torch.log" 2>&1
  note "torch: exit $?"; grep '^{' "$OUT/gpt2_torch.log" | tee -a "$S"
fi
