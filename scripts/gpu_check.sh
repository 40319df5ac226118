#!/usr/bin/env bash
# The GPU check: one command that runs every device path of loongtrain (block kernels
# against float64, the ring's decomposition overhead, timed training steps with MFU and
# the planner's prediction, and with 2+ GPUs the distributed attention and training over
# NCCL), prints one table and writes it as JSON (runs/gpu_check.json; --json FILE).
# Without a GPU, or with --device cpu, it runs the same paths at tiny sizes (the tests do).
# Extra arguments go to `loongtrain gpu-check` (see --help).
#
# Python: scripts/gpu_python.sh (a python3 whose torch sees a GPU, else the project's .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_python.sh
exec "$py" -m loongtrain gpu-check "$@"
