#!/usr/bin/env bash
# Open MPI for the `mpi` communicator and its tests (mpi-sys runs bindgen: libclang-dev).
# apt-get install once failed here with vanished temporary .deb files: retry once.
set -euo pipefail
PKGS="libopenmpi-dev openmpi-bin libclang-dev pkg-config"
if command -v mpirun >/dev/null && dpkg -s libopenmpi-dev libclang-dev >/dev/null 2>&1; then
  echo "Open MPI already installed"; exit 0
fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
install() { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends $PKGS; }
install || { echo "apt-get failed; retrying once"; sleep 5; install; }
mpirun --version | head -1
