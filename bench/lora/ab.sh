#!/usr/bin/env bash
# A LoRA training step, ferrozero against PEFT + PyTorch eager on this CPU: the same GPT shape
# (6 layers, width 384, 6 heads, vocab 4096, seq 128, micro-batch 8, tied head), LoRA r 16,
# alpha 32 on every linear layer, AdamW (lr 3e-4, betas 0.9/0.95, wd 0.1) with clipping 1.0
# over the adapters, f32, random tokens, one rank, 2 threads each. The sides alternate ROUNDS
# times (first the one, then the other, swapping each round); each run's tokens/s counts the
# steps after its first two. Prints every run and the medians, their ratio and the peak RSS.
# Usage: ROUNDS=5 STEPS=12 bash bench/lora/ab.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
ROUNDS=${ROUNDS:-5}; STEPS=${STEPS:-12}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
cargo build --release --example train_gpt >/dev/null 2>&1
python3 - "$W/tokens.bin" <<'PY'
import random, struct, sys
random.seed(0)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<%dH" % (1 << 20), *[random.randrange(4096) for _ in range(1 << 20)]))
PY
echo '{"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 16, "lora_alpha": 32,
  "target_modules": "all-linear", "lora_dropout": 0.0, "fan_in_fan_out": true}' > "$W/lora.json"
printf 'train_micro_batch_size_per_gpu = 8\ngradient_clipping = 1.0\n[zero_optimization]\nstage = 0\n[optimizer]\ntype = "AdamW"\nparams = { lr = 3e-4, betas = [0.9, 0.95], weight_decay = 0.1 }\n' > "$W/cfg.toml"
fz() {
  RAYON_NUM_THREADS=2 ./target/release/examples/train_gpt --config "$W/cfg.toml" --ranks 1 \
    --model-config bench-15m --data "$W/tokens.bin" --seq-len 128 --steps "$STEPS" \
    --peft "$W/lora.json" --no-progress --bench-json 2>/dev/null | grep '^{"bench"' \
    | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["tokens_per_s"], d["process_vmhwm_mib"] * 2**20)'
}
pt() {
  OMP_NUM_THREADS=2 python3 bench/lora/peft_step.py --steps "$STEPS" --threads 2 2>/dev/null | tail -1 \
    | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["tokens_per_s"], d["peak_rss_bytes"])'
}
: > "$W/fz"; : > "$W/pt"
for r in $(seq 1 "$ROUNDS"); do
  if (( r % 2 )); then fz >> "$W/fz"; pt >> "$W/pt"; else pt >> "$W/pt"; fz >> "$W/fz"; fi
  echo "round $r: ferrozero $(tail -1 "$W/fz") | peft $(tail -1 "$W/pt")  (tokens/s, peak RSS bytes)"
done
python3 - "$W/fz" "$W/pt" <<'PY'
import statistics, sys
def read(p):
    rows = [tuple(map(float, l.split())) for l in open(p) if l.strip()]
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
(ft, fr), (pt, pr) = read(sys.argv[1]), read(sys.argv[2])
print(f"median tokens/s: ferrozero {ft:.0f}, PEFT {pt:.0f}, ratio {ft / pt:.2f}x")
print(f"median peak RSS: ferrozero {fr / 2**20:.0f} MiB, PEFT {pr / 2**20:.0f} MiB")
PY
