#!/usr/bin/env bash
# The main job: set-up, then train the debug model on synthetic associative recall with
# 4 local CPU processes (2D attention hp=2 x cp=2 with a double ring, Selective
# Checkpoint++, ZeRO over all ranks). Prints the loss and recall accuracy as it learns,
# and where the run folder is. Extra arguments go to `loongtrain train`
# (e.g. --run.steps 100). A second run resumes from the run folder's last checkpoint;
# add --checkpoint.resume false to start fresh (the old run moves to runs/debug_cpu/previous/).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/loongtrain train --config configs/debug_cpu.toml --nproc 4 "$@"
