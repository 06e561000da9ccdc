#!/usr/bin/env bash
# Peak RSS while loading a generated 1.1B-parameter bf16 Llama checkpoint (TinyLlama's shape,
# 2.2 GB, one file) into stage-3 engines at 1 and 2 ranks, against the bound: what the built
# engines hold + ranks x the largest tensor in f32 + 48 MiB. Each load runs in its own child
# process (VmHWM reset after the engines are built). Needs about 2.5 GB of disk in
# FZ_HF_MEM_DIR (default /tmp) and about 12 GB of memory.
#
#     bench/hf_load_memory.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_BUILD_JOBS=${CARGO_BUILD_JOBS:-1}
cargo test --release --features cuda -p ferrozero-runtime --test hf_load_memory -- \
    --ignored --nocapture one_billion 2>&1 | grep -E '^ranks|test result|panicked|error'
