#!/usr/bin/env bash
# ZeRO-Infinity end to end on this machine: a 1.8B-parameter Llama whose model states
# (16 bytes per parameter: bf16 parameters and gradients, fp32 master weights and Adam
# moments) are 28.5 GB, more than this machine's 24 GiB of RAM, trained for a few steps
# with stage 3, `offload_param` and `offload_optimizer` on NVMe (the swap directory's disk).
#
# Usage: bench/nvme_end_to_end.sh [SWAP_DIR] [STEPS] [LAYERS]
# Prints one log line per step with seconds/step and NVMe bytes read and written, and the
# process's peak RSS at the end. Needs about 26 GB free under SWAP_DIR.
set -euo pipefail
swap=${1:-/var/tmp/fz-e2e-swap}
steps=${2:-4}
layers=${3:-32}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$swap"

cat > "$work/llama.json" <<JSON
{"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
 "num_hidden_layers": $layers, "num_attention_heads": 16, "num_key_value_heads": 16,
 "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
 "tie_word_embeddings": false}
JSON

# pin_memory is off: this machine's locked-memory limit (ulimit -l) is 8 MiB.
cat > "$work/ds.toml" <<TOML
train_micro_batch_size_per_gpu = 4
gradient_accumulation_steps = 1
steps_per_print = 1
wall_clock_breakdown = true

[zero_optimization]
stage = 3
sub_group_size = 10_000_000
stage3_param_persistence_threshold = 100_000
stage3_max_reuse_distance = 0

[zero_optimization.offload_param]
device = "nvme"
nvme_path = "$swap"
pin_memory = false
buffer_count = 4
buffer_size = 100_000_000

[zero_optimization.offload_optimizer]
device = "nvme"
nvme_path = "$swap"
pin_memory = false
buffer_count = 4

[aio]
block_size = 1_048_576
queue_depth = 8

[bf16]
enabled = true

[optimizer]
type = "AdamW"
params = { lr = 1e-4, weight_decay = 0.0 }
TOML

cargo build --release --example train_gpt
${WRAP:-/usr/bin/time -v} target/release/examples/train_gpt --config "$work/ds.toml" --ranks 1 \
    --model-config "$work/llama.json" --digits 3 --steps "$steps" --eval-rows 0 \
    --no-progress ${SAVE:+--save "$SAVE"} 2>&1 | grep -Ev "^\s+(Average|Exit|Socket|Signals|Swaps|Page size|File system|Voluntary|Involuntary|Minor|Major|Percent)"
