#!/usr/bin/env bash
# The one script for a lent GPU: at most 6 minutes on one H200 (its stages' timeouts add up to
# 355 s), and what it leaves in OUT comes back from the machine by construction (7 files of at
# most 16 MiB, none in a folder; at most 8 files, 64 MiB, two folders deep come back), its output
# ending with a short verdict table (every goal: measured, target, met or not).
#   bash scripts/gpu_run.sh "$OUT"               # on the GPU machine (ask for an H200)
#   bash scripts/gpu_run.sh --device cpu DIR     # the same run at tiny sizes on CPU (the tests run it)
# Stages; each writes its rows as JSON lines the moment they are measured, so a timeout loses only
# the row in flight, and starts a row only where its estimate ends inside the stage's budget:
#   check  the GPU check: kernels, offload and packed documents first, then calibration, training,
#          speed, replay, the compiled and longest rows (budget GPU_CHECK_BUDGET, killed at
#          GPU_CHECK_TIMEOUT);
#   peer   loongtrain beside transformers: 32K with one profiled step per row (PEER_32K_BUDGET /
#          _TIMEOUT), then 128K (PEER_128K_BUDGET / _TIMEOUT); loongtrain's modes PEER_CHECKPOINTS;
#   the verdict (python -m loongtrain.tools.gpucheck.verdict): gpu_check.json from the JSON lines if
#          the check was killed, OUT checked against what comes back, the failed rows, the table.
# OUT: nvidia_smi.txt, gpu_check.jsonl/.json/.log, peer.jsonl/.log, top_kernels.txt. The Chrome
# traces (too big to come back) stay on the machine in runs/gpu_run_traces ($GPU_RUN_TRACES); logs
# keep their last 4 MiB.
# A rerun of what failed: GPU_RUN_PARTS="peer" (or "check"), with its own budgets if need be.
set -uo pipefail
cd "$(dirname "$0")/.."
device=cuda
if [ "${1:-}" = --device ]; then
  device=${2:?--device needs cuda or cpu}
  shift 2
fi
case $device in cuda | cpu) ;; *) echo "gpu_run: error: --device $device: use cuda or cpu" >&2; exit 2 ;; esac
out=${1:-runs/gpu_run}
parts=" ${GPU_RUN_PARTS:-check peer} "
if [ "$device" = cuda ]; then
  short=32768 long=131072 limit=360
  check_budget=${GPU_CHECK_BUDGET:-160} check_timeout=${GPU_CHECK_TIMEOUT:-185}
  peer32_budget=${PEER_32K_BUDGET:-50} peer32_timeout=${PEER_32K_TIMEOUT:-65}
  peer128_budget=${PEER_128K_BUDGET:-90} peer128_timeout=${PEER_128K_TIMEOUT:-105}
else  # tiny sizes, no budget: every row runs
  short=64 long=128 limit=1800
  check_budget=${GPU_CHECK_BUDGET:-0} check_timeout=${GPU_CHECK_TIMEOUT:-600}
  peer32_budget=${PEER_32K_BUDGET:-0} peer32_timeout=${PEER_32K_TIMEOUT:-300}
  peer128_budget=${PEER_128K_BUDGET:-0} peer128_timeout=${PEER_128K_TIMEOUT:-300}
fi
total=0
[[ $parts == *" check "* ]] && total=$((total + check_timeout))
[[ $parts == *" peer "* ]] && total=$((total + peer32_timeout + peer128_timeout))
if [ "$total" -gt "$limit" ]; then
  echo "gpu_run: error: the stages' timeouts add up to $total s, over the $limit s a run may take on $device; lower GPU_CHECK_TIMEOUT / PEER_32K_TIMEOUT / PEER_128K_TIMEOUT or run fewer GPU_RUN_PARTS" >&2
  exit 2
fi
[ "$device" = cuda ] && export LOONGTRAIN_NEEDS_GPU=1
source scripts/gpu_python.sh  # one line and exit where this Python cannot use CUDA: nothing is installed
mkdir -p "$out"
export PYTHONUNBUFFERED=1
traces=${GPU_RUN_TRACES:-runs/gpu_run_traces}
cap() {  # a log keeps its last 4 MiB (a file comes back up to 16 MiB)
  if [ -f "$1" ] && [ "$(wc -c < "$1")" -gt 4194304 ]; then
    tail -c 4194304 "$1" > "$1.tmp" && mv "$1.tmp" "$1"
  fi
}
echo "gpu_run on $device: stages '$(echo $parts)' within $total s"
nvidia-smi > "$out/nvidia_smi.txt" 2>&1 || echo "no nvidia-smi here ($device run)" > "$out/nvidia_smi.txt"
if [[ $parts == *" check "* ]]; then
  start=$SECONDS
  timeout "$check_timeout" "$py" -m loongtrain gpu-check --device "$device" --compile extra \
    --budget-s "$check_budget" --json "$out/gpu_check.json" --jsonl "$out/gpu_check.jsonl" > "$out/gpu_check.log" 2>&1
  echo "check: rc=$? after $((SECONDS - start)) s (budget $check_budget s, timeout $check_timeout s)"
  cap "$out/gpu_check.log"
fi
if [[ $parts == *" peer "* ]]; then
  rm -rf "$traces"
  rm -f "$out/peer.jsonl"
  : > "$out/peer.log"
  peer() {  # length, steps, budget, timeout, extra arguments
    local start=$SECONDS
    timeout "$4" "$py" -m loongtrain bench train --peer transformers --model gpu-check --device "$device" \
      --lengths "$1" --checkpoint ${PEER_CHECKPOINTS:-auto sc++} --steps "$2" --budget-s "$3" \
      --jsonl "$out/peer-$1.jsonl" "${@:5}" >> "$out/peer.log" 2>&1
    echo "peer $1: rc=$? after $((SECONDS - start)) s (budget $3 s, timeout $4 s)"
    cat "$out/peer-$1.jsonl" >> "$out/peer.jsonl" 2>/dev/null
    rm -f "$out/peer-$1.jsonl"
  }
  peer "$short" 2 "$peer32_budget" "$peer32_timeout" --profile "$traces" --profile-top 12
  cp "$traces/top_kernels.txt" "$out/top_kernels.txt" 2>/dev/null
  peer "$long" 1 "$peer128_budget" "$peer128_timeout"
  cap "$out/peer.log"
fi
"$py" -m loongtrain.tools.gpucheck.verdict "$out"
