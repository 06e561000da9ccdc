#!/usr/bin/env bash
# NVRTC and ptxas from NVIDIA's PyPI wheels (no GPU, driver or toolkit needed), for the
# `cuda` feature's kernel-compile check (runtime/tests/kernels_compile.rs). They go to
# /opt/cuda-wheels; .ci/run puts nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH and points
# FERROZERO_PTXAS at nvidia/cuda_nvcc/bin/ptxas. pip, like apt, can fail transiently: retry once.
set -euo pipefail
DEST=/opt/cuda-wheels
PKGS="nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12"
if [ -e "$DEST/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ] && [ -x "$DEST/nvidia/cuda_nvcc/bin/ptxas" ]; then
  echo "CUDA wheels already installed in $DEST"; exit 0
fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! python3 -m pip --version >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends python3-pip
fi
install() {
  $SUDO python3 -m pip install --quiet --disable-pip-version-check --no-deps --upgrade \
    --target "$DEST" $PKGS
}
install || { echo "pip install failed; retrying once"; sleep 5; install; }
ls "$DEST/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" "$DEST/nvidia/cuda_nvcc/bin/ptxas"
