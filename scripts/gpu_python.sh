# Sourced by the GPU scripts: sets $py, the Python to run loongtrain with, and puts src/ on
# PYTHONPATH. $LOONGTRAIN_PYTHON if set; else a python3 (3.11+) whose torch sees a GPU (a GPU
# machine's own CUDA build: nothing is installed, loongtrain is imported from src/); else the
# project's .venv from scripts/setup.sh (the pinned CPU wheel).
sees_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if sys.version_info >= (3, 11) and torch.cuda.is_available() else 1)' >/dev/null 2>&1; }
if [ -n "${LOONGTRAIN_PYTHON:-}" ]; then
  py=$LOONGTRAIN_PYTHON
elif command -v python3 >/dev/null 2>&1 && sees_gpu python3; then
  py=python3
else
  bash scripts/setup.sh
  py=.venv/bin/python
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
# fewer out-of-memory failures from fragmentation at 128K tokens (ignored on CPU)
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
