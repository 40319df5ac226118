# Sourced by the GPU scripts: sets $py, the Python to run loongtrain with, and puts src/ on
# PYTHONPATH. $LOONGTRAIN_PYTHON if set; else a python3 (3.11+) whose torch sees a GPU (a GPU
# machine's own CUDA build: nothing is installed, loongtrain is imported from src/); else, on a
# machine without a GPU, the project's .venv from scripts/setup.sh (the pinned CPU wheel).
# Where a GPU is needed (LOONGTRAIN_NEEDS_GPU=1, as scripts/gpu_run.sh sets on a GPU) or there is
# one (nvidia-smi runs) and no Python imports torch with CUDA, it says why in one line and stops:
# a GPU machine reaches no network, so it never falls back to an install there.
gpu_python_problem() {  # why "$1" cannot run the GPU paths (one line; empty and status 0 if it can)
  "$1" - <<'EOF' 2>/dev/null || echo "$1 does not run"
import sys
if sys.version_info < (3, 11):
    print(f"Python {sys.version.split()[0]} is older than 3.11"); sys.exit()
try:
    import torch
except Exception as exc:
    print(f"cannot import torch ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]})"); sys.exit()
if not torch.cuda.is_available():
    print(f"torch {torch.__version__} sees no CUDA device")
EOF
}
needs_gpu=${LOONGTRAIN_NEEDS_GPU:-0}
sees_cuda=0
if [ -n "${LOONGTRAIN_PYTHON:-}" ]; then
  py=$LOONGTRAIN_PYTHON
elif command -v python3 >/dev/null 2>&1 && why=$(gpu_python_problem python3) && [ -z "$why" ]; then
  py=python3 sees_cuda=1
elif [ "$needs_gpu" = 1 ] || nvidia-smi >/dev/null 2>&1; then
  echo "error: no Python here imports torch with CUDA (python3: ${why:-not found}); nothing is installed on a GPU machine: set LOONGTRAIN_PYTHON to a Python whose torch sees the GPU" >&2
  exit 1
else
  bash scripts/setup.sh
  py=.venv/bin/python
fi
if [ "$needs_gpu" = 1 ] && [ "$sees_cuda" = 0 ] && why=$(gpu_python_problem "$py") && [ -n "$why" ]; then
  echo "error: $py cannot run the GPU paths: $why; nothing is installed on a GPU machine: set LOONGTRAIN_PYTHON to a Python whose torch sees the GPU" >&2
  exit 1
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# fewer out-of-memory failures from fragmentation at 128K tokens (ignored on CPU)
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
