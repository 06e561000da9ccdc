#!/usr/bin/env bash
# Builds what a GPU session runs into .gpu/ (git-ignored through .git/info/exclude): the CUDA
# build of train_gpt and the ferrozero CLI, the GPU test binaries (device ops, the engine on the
# device, the driver checks, the kernel compile check), stripped, with ../shared/bench/gpu's
# scripts and bench/gpu/session.sh beside them. Then, with the device tool:
#   run(command="bash .gpu/session.sh", carry=[".gpu"], timeout_s=600)
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
  --test device_modules --test device_streams --test nn_memory \
  --test cuda_driver_memory --test cuda_driver_gemm --test cuda_driver_gemm_epilogues \
  --test cuda_driver_gemm_refusals --test cuda_driver_launches \
  --test cuda_driver_allocator --test kernels_compile 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' |
  while read -r name exe; do cp "$exe" ".gpu/tests/$name"; done
strip .gpu/train_gpt .gpu/ferrozero .gpu/tests/*
cp ../shared/bench/gpu/*.py ../shared/bench/gpu/*.sh .gpu/ 2>/dev/null || true
cp bench/gpu/session.sh .gpu/
# kernels_compile reads the sources from the repository checkout, which travels with the run.
du -sh .gpu; ls -la .gpu .gpu/tests
