#!/usr/bin/env bash
# The one script for a lent GPU (about 7 minutes on one H200): the GPU check (every device path,
# the ceiling and the training rows; its checks within --budget-s), then the 1.1B model beside
# transformers at 32K and 128K (the planner's policy and sc++ forced; transformers with and
# without its checkpointing), one profiled step per row at 32K. Everything goes to OUT (default
# runs/gpu_run): gpu_check.json/.log, peer_32k/peer_128k .json/.log, profile/ (traces,
# top_kernels.txt), nvidia_smi.txt.
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
# 32K with one profiled step per row (where launches show), then 128K with one timed step
timeout "${PEER_TIMEOUT:-100}" "$py" -m loongtrain bench train --peer transformers --model gpu-check \
  --lengths 32768 --checkpoint auto sc++ --steps 2 --json "$out/peer_32k.json" --profile "$out/profile" \
  --profile-top 12 > "$out/peer_32k.log" 2>&1
echo "peer 32K rc=$?"
timeout "${PEER_TIMEOUT:-100}" "$py" -m loongtrain bench train --peer transformers --model gpu-check \
  --lengths 131072 --checkpoint auto sc++ --steps 1 --json "$out/peer_128k.json" > "$out/peer_128k.log" 2>&1
echo "peer 128K rc=$?"
grep -E "FAIL|failed,|below goal|goal met|Error|ceiling" "$out/gpu_check.log" | cut -c1-330 | tail -60
grep -hvE "^\[bench train\]|USDT" "$out/peer_32k.log" "$out/peer_128k.log" | cut -c1-200 | head -80
