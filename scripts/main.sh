#!/usr/bin/env bash
# The main job: set-up, then train the debug model on synthetic associative recall with
# 4 local CPU processes (2D attention hp=2 x cp=2 with a double ring, Selective
# Checkpoint++, ZeRO over all ranks). Prints the loss and recall accuracy as it learns,
# and where the run folder is. Extra arguments go to `loongtrain train`
# (e.g. --run.steps 100). A second run resumes from the run folder's last checkpoint;
# add --checkpoint.resume false to start fresh (the old run moves to runs/debug_cpu/previous/).
# It ends with `loongtrain eval` of the newest checkpoint on the same 4-rank layout: the
# needle heatmap (a fact placed at each depth of contexts up to the trained length, asked
# at the end: the answer lies on another rank's shard), as a table and a PNG.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/loongtrain train --config configs/debug_cpu.toml --nproc 4 "$@"
run=runs/debug_cpu
for ((i = 1; i <= $#; i++)); do  # the run folder, if the arguments moved it
  case "${!i}" in
    --run.output_dir=*) run="${!i#*=}" ;;
    --run.output_dir) j=$((i + 1)); run="${!j}" ;;
  esac
done
exec .venv/bin/loongtrain eval "$run" --nproc 4
