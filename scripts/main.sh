#!/usr/bin/env bash
# The main job: set-up, then the distributed-attention demo on 4 local CPU processes
# (2D head-context attention under every standard layout, checked against full
# attention, with timings). Extra arguments go to `loongtrain demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/loongtrain demo "$@"
