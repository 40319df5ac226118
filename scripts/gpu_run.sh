#!/usr/bin/env bash
# The one script for a lent GPU (about 7 minutes on one H200): the GPU check (every device path,
# the ceiling and the training rows; its checks within --budget-s), then the 1.1B model beside
# transformers at 32K and 128K (the planner's policy and sc++ forced; transformers with and
# without its checkpointing) with one profiled step per row. Everything goes to OUT (default
# runs/gpu_run): gpu_check.json/.log, peer.json/.log, profile/ (traces, top_kernels.txt), nvidia_smi.txt.
#   bash scripts/gpu_run.sh "$OUT"
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/gpu_run}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi > "$out/nvidia_smi.txt" 2>&1
timeout "${GPU_CHECK_TIMEOUT:-330}" bash scripts/gpu_check.sh --budget-s "${GPU_CHECK_BUDGET:-230}" \
  --json "$out/gpu_check.json" > "$out/gpu_check.log" 2>&1
echo "gpu_check rc=$?"
source scripts/gpu_python.sh
timeout "${PEER_TIMEOUT:-120}" "$py" -m loongtrain bench train --peer transformers --model gpu-check \
  --lengths 32768 131072 --checkpoint auto sc++ --steps 2 --json "$out/peer.json" --profile "$out/profile" \
  --profile-top 12 > "$out/peer.log" 2>&1
echo "peer rc=$?"
grep -E "FAIL|failed,|below goal|goal met|Error|ceiling" "$out/gpu_check.log" | cut -c1-330 | tail -60
grep -vE "^\[bench train\]|USDT" "$out/peer.log" | cut -c1-200 | head -60
