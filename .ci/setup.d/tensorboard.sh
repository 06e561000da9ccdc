#!/usr/bin/env bash
# TensorBoard's own reader for the monitor test (runtime/tests/monitor_tensorboard.rs reads
# ferrozero's event files back with it; under CI the test fails without it). pip can fail
# transiently: retry once.
set -euo pipefail
if python3 -c "import tensorboard" 2>/dev/null; then
  echo "tensorboard already installed"; exit 0
fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
if ! python3 -m pip --version >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends python3-pip
fi
install() { $SUDO python3 -m pip install --quiet --disable-pip-version-check tensorboard; }
install || { echo "pip install failed; retrying once"; sleep 5; install; }
python3 -c "from tensorboard.backend.event_processing import event_accumulator"
