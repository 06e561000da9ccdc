#!/usr/bin/env bash
# Proves that two builds train bit for bit alike on the CPU: runs the same matrix of training jobs
# with the binaries in OLD and NEW (each a folder holding train_gpt, finetune_llama, custom_module
# and ferrozero) and compares every step's loss, gradient norm, loss scale and learning rate to
# the last bit, the consolidated parameters byte for byte, and the examples' printed output.
# Use it around any refactor of the compute path (it is how the storage/view refactor was checked).
# Usage: bash bench/bitwise_ab.sh OLD_DIR NEW_DIR      (exit 1 on the first difference)
set -euo pipefail
OLD=$(cd "$1" && pwd); NEW=$(cd "$2" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
cd "$W"

bf16_cfg() {  # stage overlap ckpt -> a bf16 config on stdout
  cat <<EOF
{"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "seed": 7,
 "bf16": {"enabled": true}, "zero_optimization": {"stage": $1, "overlap_comm": $2},
 "activation_checkpointing": {"partition_activations": $3},
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}}
EOF
}
bf16_cfg 0 false false > bf16_s0.json
bf16_cfg 3 true true > bf16_s3_ckpt.json
bf16_cfg 1 false false > bf16_s1.json
# SGD with momentum and Lion, and ZeRO-Infinity (optimizer state and stage-3 parameters on NVMe).
echo '{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "seed": 3,
 "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9, "nesterov": true, "weight_decay": 0.01}}}' > sgd.json
echo '{"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "seed": 3, "bf16": {"enabled": true},
 "zero_optimization": {"stage": 1}, "optimizer": {"type": "Lion", "params": {"lr": 1e-4, "weight_decay": 0.1}}}' > lion.json
nvme_cfg() {  # swap directory
  echo "{\"train_micro_batch_size_per_gpu\": 4, \"gradient_accumulation_steps\": 2, \"seed\": 5, \"bf16\": {\"enabled\": true},
 \"zero_optimization\": {\"stage\": 3, \"sub_group_size\": 1000,
   \"offload_optimizer\": {\"device\": \"nvme\", \"nvme_path\": \"$1\"}, \"offload_param\": {\"device\": \"nvme\", \"nvme_path\": \"$1\"}},
 \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-3}}}"
}
mkdir -p nvme_old nvme_new
nvme_cfg "$W/nvme_old" > nvme_old.json
nvme_cfg "$W/nvme_new" > nvme_new.json
# A GPT-2 with every dropout on, so the masks are compared too.
echo '{"model_type":"gpt2","n_layer":2,"n_head":4,"n_embd":64,"vocab_size":256,"n_positions":64,"resid_pdrop":0.1,"embd_pdrop":0.1,"attn_pdrop":0.1}' > dropout.json

# LoRA adapters (PEFT's config) on the attention and MLP input layers, with adapter dropout.
echo '{"peft_type": "LORA", "r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": ["c_attn", "c_fc"]}' > lora.json

# name | model | ranks | config [| extra train_gpt arguments]
JOBS=(
  "default|addition|2|$ROOT/configs/default.toml"
  "zero1|addition|2|$ROOT/configs/zero1.toml"
  "zero2_bf16|addition|2|$ROOT/configs/zero2.toml"
  "zero3_bf16|llama-tiny|2|$ROOT/configs/zero3.toml"
  "zero3_offload|tiny|2|$ROOT/configs/zero3_offload_cpu.toml"
  "fp16|tiny|1|$ROOT/configs/fp16_dynamic_scale.toml"
  "bf16_s0|llama-tiny|1|$W/bf16_s0.json"
  "bf16_s1_4ranks|tiny|4|$W/bf16_s1.json"
  "bf16_s3_ckpt|llama-tiny|2|$W/bf16_s3_ckpt.json"
  "dropout_s3|$W/dropout.json|2|$W/bf16_s3_ckpt.json"
  "sgd_s2|tiny|2|$W/sgd.json"
  "lion_s1|tiny|2|$W/lion.json"
  "nvme_s3|llama-tiny|2|$W/nvme_SIDE.json"
  "frozen_s3|tiny|2|$W/bf16_s3_ckpt.json|--freeze transformer.w?e.weight transformer.h.0.*"
  "lora_s2|tiny|2|$ROOT/configs/zero2.toml|--peft $W/lora.json"
)

fields='import json,sys
for l in open(sys.argv[1]):
    if l.startswith("{"):
        m = json.loads(l)
        print(m["step"], repr(m["loss"]), repr(m["grad_norm"]), repr(m["loss_scale"]), repr(m["lr"]), m["skipped"])'

# Tensor bytes in name order (the metadata map's key order varies from run to run).
digest='import hashlib,json,struct,sys
import os; p = sys.argv[1]  # consolidation writes a model directory
d = open(os.path.join(p, "model.safetensors") if os.path.isdir(p) else p, "rb").read(); n = struct.unpack("<Q", d[:8])[0]
h = {k: v for k, v in json.loads(d[8:8 + n]).items() if k != "__metadata__"}
for k in sorted(h):
    a, b = h[k]["data_offsets"]
    print(k, h[k]["dtype"], h[k]["shape"], hashlib.sha256(d[8 + n + a:8 + n + b]).hexdigest())'

fail=0
run_side() {  # side dir name model ranks config extra
  local out=$W/$1/$3 cfg=${6/SIDE/$1} extra; mkdir -p "$out"
  read -ra extra <<<"$7"  # words, never globbed
  "$2/train_gpt" --config "$cfg" --model-config "$4" --ranks "$5" --steps 25 --no-progress \
    --metrics "$out/m.jsonl" --save "$out/ck" --eval-rows 64 "${extra[@]}" > "$out/log" 2>&1
  python3 -c "$fields" "$out/m.jsonl" > "$out/steps"
  "$OLD/ferrozero" checkpoint consolidate "$out/ck" -o "$out/model.st" > /dev/null
  # consolidate writes a model directory now (config, shards); older binaries wrote one file.
  if [ -d "$out/model.st" ]; then
    find "$out/model.st" -type f | sort | while read -r f; do
      case "$f" in *.safetensors) python3 -c "$digest" "$f";; *) sha256sum < "$f";; esac
    done > "$out/params"
  else python3 -c "$digest" "$out/model.st" > "$out/params"; fi
  grep -o 'heldout_loss=.*' "$out/log" > "$out/heldout" || true
}
for job in "${JOBS[@]}"; do
  IFS='|' read -r name model ranks cfg extra <<<"$job"
  run_side old "$OLD" "$name" "$model" "$ranks" "$cfg" "$extra"
  run_side new "$NEW" "$name" "$model" "$ranks" "$cfg" "$extra"
  verdict=same
  for f in steps heldout params; do
    cmp -s "old/$name/$f" "new/$name/$f" || { verdict="DIFFERENT ($f)"; fail=1; }
  done
  printf '%-16s %-11s %s ranks  %3s steps compared  %s\n' "$name" "$(basename "$model" .json)" "$ranks" \
    "$(wc -l < "old/$name/steps")" "$verdict"
  [ "$verdict" = same ] || diff "old/$name/steps" "new/$name/steps" | head -5 || true
done

# The two other examples print their losses and checks; their text must match exactly.
for side in old new; do
  d=$OLD; [ $side = new ] && d=$NEW
  mkdir -p "$side/ft"
  "$d/finetune_llama" --out "$side/ft" --steps 20 --print-every 1 2>&1 | grep -v -e INFO -e "$side/ft" > "$side/ft.txt"
  python3 -c "$digest" "$side/ft/model.safetensors" >> "$side/ft.txt"
  "$d/custom_module" --steps 20 2>&1 | grep -v INFO > "$side/cm.txt"
done
for f in ft.txt cm.txt; do
  if cmp -s "old/$f" "new/$f"; then echo "example ${f%.txt}: same"; else echo "example ${f%.txt}: DIFFERENT"; diff "old/$f" "new/$f" | head || true; fail=1; fi
done
[ $fail = 0 ] && echo "bitwise: all identical" || { echo "bitwise: differences found"; exit 1; }
