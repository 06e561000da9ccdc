#!/usr/bin/env bash
# Builds what a GPU session runs into .gpu/ (git-ignored through .git/info/exclude): the CUDA
# build of train_gpt and the ferrozero CLI, the test binaries with real-GPU cases (the driver
# checks, the device ops and layers, the engine on the device), stripped, with
# ../shared/bench/gpu's baseline scripts, DeepSpeed's wheels (.gpu/whl) and
# bench/gpu/session.sh beside them. Then, with the device tool:
#   run(command="BUDGET_S=480 bash .gpu/session.sh", carry=[".gpu"], timeout_s=540)
# Usage (from the repository root): bash bench/gpu/prepare.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
rm -rf .gpu && mkdir -p .gpu/tests
cargo build --release --features cuda --example train_gpt --bin ferrozero
cp target/release/examples/train_gpt target/release/ferrozero .gpu/
# The test executables cargo reports for the GPU-facing tests.
cargo test --release --features cuda -p ferrozero-runtime --no-run --message-format=json \
  --test device_ops --test device_ops_layers --test device_ops_training --test device_engine \
  --test device_modules --test device_streams --test device_matmul_backward --test device_head \
  --test device_fused --test device_whole_step --test device_grad_move --test device_grad_read \
  --test device_lamb --test device_bf16_state --test device_quant --test device_zeropp \
  --test device_grad_accum --test device_frozen \
  --test cuda_driver_memory --test cuda_driver_gemm --test cuda_driver_gemm_epilogues \
  --test cuda_driver_gemm_refusals --test cuda_driver_launches \
  --test cuda_driver_allocator 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
  while read -r name exe; do cp "$exe" ".gpu/tests/$name"; done
strip .gpu/train_gpt .gpu/ferrozero .gpu/tests/*
# The test binaries share most of their code: compressed they are a tenth (the carried tree's
# limit is 64 MiB); session.sh unpacks them.
tar -C .gpu -cf - tests | xz -T0 -6 > .gpu/tests.tar.xz && rm -r .gpu/tests
cp ../shared/bench/gpu/*.py ../shared/bench/gpu/*.sh .gpu/ 2>/dev/null || true
[ -x ../shared/bench/gpu/prepare_wheels.sh ] && bash ../shared/bench/gpu/prepare_wheels.sh .gpu/whl > /dev/null
cp bench/gpu/session.sh bench/gpu/*.py .gpu/
du -sh .gpu; ls -la .gpu
